"""The module map (docs/design.md, section 18, between the ``module map`` markers) names every module of
``src/npu_train`` and nothing that is not there; ``__init__.py`` files are covered by their package's heading."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "npu_train"
START, END = "<!-- module map: start -->", "<!-- module map: end -->"
MAP_FILE = "docs/design.md"


def _map_text() -> str:
    text = (REPO / MAP_FILE).read_text()
    assert START in text and END in text, f"{MAP_FILE} lacks the module map markers {START} ... {END}"
    return text.split(START, 1)[1].split(END, 1)[0]


def _mapped_modules(text: str) -> set[str]:
    """Paths relative to ``src/npu_train`` named in backticks at the start of a map line (``- `x/y.py` — ...``)."""
    return set(re.findall(r"^- `([\w/]+\.py)`", text, flags=re.M))


def _source_modules() -> set[str]:
    return {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if p.name != "__init__.py"}


def test_every_module_is_in_the_module_map():
    missing = sorted(_source_modules() - _mapped_modules(_map_text()))
    assert not missing, f"add a line for each to the module map in docs/design.md ('- `pkg/mod.py` — what for'): {missing}"


def test_module_map_names_only_existing_modules():
    stale = sorted(_mapped_modules(_map_text()) - _source_modules())
    assert not stale, f"the module map in docs/design.md names modules that do not exist under src/npu_train: {stale}"


def test_every_package_has_a_heading_in_the_map():
    text = _map_text()
    packages = {p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if p.parent != SRC}
    missing = sorted(pkg for pkg in packages if f"`{pkg}/`" not in text)
    assert not missing, f"give each package a heading in the module map in docs/design.md: {missing}"


def test_each_module_appears_once_in_the_map():
    names = re.findall(r"^- `([\w/]+\.py)`", _map_text(), flags=re.M)
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"listed more than once in the module map in docs/design.md: {dup}"
