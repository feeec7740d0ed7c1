#!/usr/bin/env python
"""Docstring lines as a share of source lines under src/ (module, class and function docstrings, via AST).

Usage: ``python scripts/doc_stats.py [--top N] [--files] [ROOT]`` (ROOT defaults to ``src/npu_train``).
Prints per package and in total: docstring lines / all lines of the ``.py`` files, then the N longest docstrings.
"""
from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parents[1] / "src" / "npu_train"
_DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstrings(path: Path):
    """(owner name, first line, line count) of every module/class/function docstring in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, _DOC_OWNERS) or not node.body:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            name = "<module>" if isinstance(node, ast.Module) else node.name
            yield name, first.lineno, first.end_lineno - first.lineno + 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--top", type=int, default=15, help="how many of the longest docstrings to list")
    ap.add_argument("--files", action="store_true", help="also print the share per file")
    args = ap.parse_args(argv)

    total, doc, module_doc = defaultdict(int), defaultdict(int), 0
    per_file, longest = [], []
    for path in sorted(args.root.rglob("*.py")):
        rel = path.relative_to(args.root).as_posix()
        pkg = rel.split("/")[0] if "/" in rel else "(top level)"
        n = len(path.read_text().splitlines())
        d = 0
        for name, line, count in docstrings(path):
            d += count
            module_doc += count if name == "<module>" else 0
            longest.append((count, f"{rel}:{line} {name}"))
        total[pkg] += n
        doc[pkg] += d
        per_file.append((rel, d, n))

    def row(label, d, n):
        print(f"{label:<28} {d:>6} / {n:>6}  {100 * d / max(n, 1):5.1f} %")

    print(f"{'package':<28} {'doc':>6}   {'lines':>6}")
    for pkg in sorted(total):
        row(pkg, doc[pkg], total[pkg])
    row("TOTAL", sum(doc.values()), sum(total.values()))
    print(f"module docstrings: {module_doc} lines")
    if args.files:
        print()
        for rel, d, n in per_file:
            row(rel, d, n)
    print("\nlongest docstrings (lines):")
    for count, where in sorted(longest, reverse=True)[:args.top]:
        print(f"{count:>5}  {where}")


if __name__ == "__main__":
    main()
