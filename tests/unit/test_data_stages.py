"""The data flows one way (issue 42): every ``data.format`` goes down the same stages, read rows -> render
samples -> pack -> cache file with lock -> batches, each in modules named for it, and no stage module imports
a later one (lazy imports inside functions count). ``prepare.py`` composes the stages; ``text.py`` (errors,
the shipped text) and ``packfile.py`` (the file format every stage writes or reads) import no stage.
Checked statically from the source (AST)."""
from __future__ import annotations

import ast
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "src" / "npu_train" / "data"

#: the stage modules in data-flow order (a module may import only the ones before it)
STAGES = [
    "sources", "rows",    # 1. read rows
    "render",             # 2. render samples (text, chat, preference)
    "spool", "pack",      # 3. pack rows into the file
    "cache",              # 4. cache file with lock
    "sampler", "batches",  # 5. batches (card processes)
]
#: modules below every stage (they import none)
SHARED = ["text", "packfile"]
#: the composer: imports every stage, imported by none
COMPOSER = "prepare"


def _data_imports(path: Path) -> set[str]:
    """The ``npu_train.data`` modules ``path`` imports anywhere in it (relative or absolute, lazy included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:
                out.update(a.name for a in node.names)
            elif node.level == 0 and (node.module or "").startswith("npu_train.data."):
                out.add(node.module.split(".")[2])
            elif node.level == 0 and node.module == "npu_train.data":
                out.update(a.name for a in node.names if (DATA / f"{a.name}.py").is_file())
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("npu_train.data."):
                    out.add(a.name.split(".")[2])
    return out


def _modules() -> list[str]:
    return sorted(p.stem for p in DATA.glob("*.py") if p.stem != "__init__")


def test_every_data_module_has_a_place_in_the_stages():
    placed = set(STAGES) | set(SHARED) | {COMPOSER}
    assert set(_modules()) == placed, (f"place each module of src/npu_train/data in STAGES / SHARED here (and in "
                                       f"the module map): new {sorted(set(_modules()) - placed)}, "
                                       f"gone {sorted(placed - set(_modules()))}")


def test_no_stage_imports_a_later_stage():
    bad = []
    for i, name in enumerate(STAGES):
        later = set(STAGES[i + 1:]) | {COMPOSER}
        bad += [f"{name}.py imports {m}.py (a later stage)" for m in sorted(_data_imports(DATA / f"{name}.py") & later)]
    assert not bad, "\n".join(bad)


def test_shared_modules_import_no_stage():
    bad = []
    for name in SHARED:
        got = _data_imports(DATA / f"{name}.py") & (set(STAGES) | {COMPOSER})
        bad += [f"{name}.py imports {m}.py" for m in sorted(got)]
    assert not bad, "\n".join(bad)


def test_the_composer_uses_every_build_stage():
    """prepare.py sends the data down stages 1-4 itself (the card processes do stage 5)."""
    got = _data_imports(DATA / f"{COMPOSER}.py")
    missing = {"sources", "rows", "render", "pack", "cache"} - got
    assert not missing, f"prepare.py does not use {sorted(missing)}"


def test_the_checker_sees_lazy_and_absolute_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from .rows import x\n\ndef f():\n    from npu_train.data.pack import y\n    from . import cache\n")
    assert _data_imports(p) == {"rows", "pack", "cache"}
