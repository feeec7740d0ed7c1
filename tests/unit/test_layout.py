"""The package layout stays as the README's design map says (DESIGN.md section 9).

Dependencies point one way: runtime -> (pipeline, planner, checkpoint, metrics) -> (model, transport,
optim, backends, data) -> config -> (errors, hardware, env, hostmem). A module may import its own layer or a
lower one, never a higher one; the package-level import graph has no cycle; nothing reaches into
another module's private (``_underscore``) names; no source file is longer than ``MAX_LINES`` unless it
is listed in ``LONG_FILES`` with its reason. Checked statically (AST), so lazy imports inside functions
and imports inside code strings count too.
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
MAX_LINES = 500
#: files allowed over MAX_LINES, with the reason
LONG_FILES = {
    "transport/channel.py": "one protocol (mailbox, outbox, credit flow control, tensor link) whose parts share "
                            "private framing helpers; split would expose them",
    "checkpoint/store.py": "the checkpoint format in one place: the writer (shards, manifest, atomic publish, "
                           "rotation) and the reader that checks it (resume refusals, damaged-shard checks); to split "
                           "into store.py + reader.py (CheckpointReader has 14 importers)",
    "backends/furiosa.py": "the furiosa-torch API surface in one place (probe, fusion/mesh setup, memory accounting), "
                           "reviewed against the installed package as a unit",
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
    assert not missing, f"add these to LAYERS (and the README's design map): {missing}"


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


@pytest.mark.parametrize("rel", [r for r, _ in _modules()])
def test_source_file_size(rel):
    n = sum(1 for _ in open(SRC / rel))
    if rel in LONG_FILES:
        return
    assert n <= MAX_LINES, f"{rel} has {n} lines (> {MAX_LINES}): split it, or list it in LONG_FILES with a reason"


def test_user_errors_share_one_base():
    """Every exception class meant for the user derives from ``npu_train.errors.UserError``."""
    from npu_train.backends import BackendSpecError, BackendUnavailableError
    from npu_train.checkpoint.store import CheckpointError
    from npu_train.errors import ConfigError, UserError
    from npu_train.transport.shm import ShmTooSmallError

    for cls in (BackendSpecError, BackendUnavailableError, CheckpointError, ConfigError, ShmTooSmallError):
        assert issubclass(cls, UserError), cls
