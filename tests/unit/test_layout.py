"""The package layout stays as docs/design.md says (section 9; the module map is section 18).

Dependencies point one way: runtime -> (pipeline, planner, checkpoint, metrics) -> (model, transport,
optim, backends, data) -> config -> (errors, hardware, env, hostmem). A module may import its own layer or a
lower one, never a higher one; neither packages nor files import each other in a circle; nothing
reaches into another module's private (``_underscore``) names; no function is above cyclomatic
complexity ``MAX_COMPLEXITY`` unless ``COMPLEX`` gives the reason. Checked statically (AST, radon), so
lazy imports inside functions and imports inside code strings count too. Test modules have names unique across
``tests/`` (no ``__init__.py`` there: pytest's default import mode refuses two of one name in one session).
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "npu_train"

#: layer of each sub-package / top-level module (higher imports lower)
LAYERS = {
    "errors": 0, "hardware": 0, "env": 0, "ownership": 0, "hostmem": 0, "stackdump": 0,
    "config": 1,
    "model": 2, "transport": 2, "optim": 2, "backends": 2, "data": 2,
    "pipeline": 3, "planner": 3, "checkpoint": 3, "metrics": 3,
    "runtime": 4, "calibrate": 4,
    "generate": 5,
}
#: file-level import circles allowed in src (frozenset of modules: reason); none today
KNOWN_CIRCLES: dict[frozenset, str] = {}
MAX_COMPLEXITY = 25
#: functions above MAX_COMPLEXITY (radon's cyclomatic complexity), "file.py::Qualified.name": reason
COMPLEX: dict[str, str] = {
    "planner/search.py::fastest_split.dfs": "the branch-and-bound's inner loop, run tens of millions of times on "
    "an 8-card MoE LoRA plan: its bounds are written out inline (no helper calls, no max()) for speed; before "
    "that and its early stop the same search took 82-86 CPU s against 25.8; it starts each loop past the options "
    "whose rest alone is cut (bisected) and stops at the drain bound too, 2.65 CPU s to 1.55 for a qwen3-30b-a3b "
    "LoRA 1f1b search (experiments/2026-12-07-plan-search.md)",
}


def _modules():
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC).as_posix()
        yield rel, p


def _package_of(rel: str) -> str:
    head = rel.split("/")[0]
    return head[:-3] if head.endswith(".py") else head


def _imports(path: Path):
    """(module name, imported names) for every import in the file, plus ``npu_train.*`` names in strings."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in re.findall(r"(?:from|import)\s+(npu_train(?:\.\w+)+)", node.value):
                yield m, []


def _target_package(module: str):
    if not module.startswith("npu_train."):
        return None
    return module.split(".")[1]


def test_every_package_has_a_layer():
    missing = sorted({_package_of(rel) for rel, _ in _modules()} - set(LAYERS) - {"__init__"})
    assert not missing, f"add these to LAYERS (and the module map in docs/design.md): {missing}"


def test_no_upward_imports():
    bad = []
    for rel, path in _modules():
        own = _package_of(rel)
        if own == "__init__":
            continue
        for module, _ in _imports(path):
            tgt = _target_package(module)
            if tgt is None or tgt == own or tgt not in LAYERS:
                continue
            if LAYERS[tgt] > LAYERS[own]:
                bad.append(f"{rel} imports {module} (layer {LAYERS[tgt]} > {LAYERS[own]})")
    assert not bad, "\n".join(bad)


def test_no_package_import_cycle():
    graph: dict[str, set[str]] = {}
    for rel, path in _modules():
        own = _package_of(rel)
        for module, _ in _imports(path):
            tgt = _target_package(module)
            if tgt and tgt != own and tgt in LAYERS:
                graph.setdefault(own, set()).add(tgt)

    def reach(a, seen):
        for b in graph.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    cycles = [a for a in graph if a in reach(a, set())]
    assert not cycles, f"package import cycle through {cycles}: {graph}"


def test_no_import_circle_inside_backends():
    """``backends/base.py`` (the interface) imports no concrete backend and not ``spec``/``registry``."""
    names = {m for m, _ in _imports(SRC / "backends" / "base.py")}
    assert not {n for n in names if n.startswith("npu_train.backends.")}, names


def test_no_private_names_of_other_modules():
    bad = []
    for rel, path in _modules():
        tree = ast.parse(path.read_text())
        own_mod = "npu_train." + rel[:-3].replace("/", ".").removesuffix(".__init__")
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("npu_train"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and node.module != own_mod:
                        bad.append(f"{rel}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("npu_train"):
                        aliases[a.asname or a.name.split(".")[0]] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{rel}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not bad, "\n".join(bad)


def _module_name(rel: str) -> str:
    return "npu_train." + rel[:-3].replace("/", ".").removesuffix(".__init__")


def _file_graph() -> dict[str, set[str]]:
    """{module: modules of src it imports} from every import statement, lazy ones inside functions too
    (``from pkg import mod`` counts as an import of ``pkg.mod`` when that is a module)."""
    names = {_module_name(rel) for rel, _ in _modules()}
    graph: dict[str, set[str]] = {}
    for rel, path in _modules():
        own = _module_name(rel)
        pkg = own if rel.endswith("__init__.py") else own.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        graph[own] = {m for m in out if m in names and m != own}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circles_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_file_import_circle():
    circles = [c for c in _circles(_file_graph()) if c not in KNOWN_CIRCLES]
    assert not circles, f"files importing each other in a circle (lazy imports count): {[sorted(c) for c in circles]}"


def test_known_circles_still_exist():
    """An entry of KNOWN_CIRCLES whose circle is gone is removed from the list."""
    gone = set(KNOWN_CIRCLES) - set(_circles(_file_graph()))
    assert not gone, f"remove from KNOWN_CIRCLES: {[sorted(c) for c in gone]}"


def _complexities():
    from radon.complexity import cc_visit

    for rel, path in _modules():
        for block in cc_visit(path.read_text()):
            name = f"{block.classname}.{block.name}" if getattr(block, "classname", None) else block.name
            yield f"{rel}::{name}", block.complexity
            for inner in getattr(block, "closures", []):
                yield f"{rel}::{name}.{inner.name}", inner.complexity


def test_function_complexity():
    found = dict(_complexities())
    over = [f"{k} ({v})" for k, v in found.items() if v > MAX_COMPLEXITY and k not in COMPLEX]
    assert not over, (f"above cyclomatic complexity {MAX_COMPLEXITY}: split by concept, or list in COMPLEX with "
                      f"the reason: {over}")
    stale = [k for k in COMPLEX if found.get(k, 0) <= MAX_COMPLEXITY]
    assert not stale, f"remove from COMPLEX (now <= {MAX_COMPLEXITY} or gone): {stale}"


def test_user_errors_share_one_base():
    """Every exception class meant for the user derives from ``npu_train.errors.UserError``."""
    from npu_train.backends import BackendSpecError, BackendUnavailableError
    from npu_train.checkpoint.store import CheckpointError
    from npu_train.errors import ConfigError, UserError
    from npu_train.transport.shm import ShmTooSmallError

    for cls in (BackendSpecError, BackendUnavailableError, CheckpointError, ConfigError, ShmTooSmallError):
        assert issubclass(cls, UserError), cls


def test_test_module_names_are_unique():
    """Two ``test_x.py`` under different folders of ``tests/`` stop the whole suite at collection ("import file
    mismatch") though each folder alone runs: the CI command collects them together."""
    seen: dict[str, list[str]] = {}
    for path in sorted(SRC.parents[1].joinpath("tests").rglob("*.py")):
        if "__pycache__" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(SRC.parents[1])))
    clashes = {name: where for name, where in seen.items() if len(where) > 1 and name != "conftest.py"}
    assert not clashes, f"rename one of each: {clashes}"
