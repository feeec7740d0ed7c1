"""Every relative link in README.md and docs/*.md resolves: the file or directory exists and a ``#anchor`` names a
heading of the target file (GitHub's slug: lower case, punctuation dropped, spaces to ``-``). Links to web pages
(``http(s)://``, ``mailto:``) are not followed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: ``[text](target)``; a target has no spaces (titles after a space are not used in these docs)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup removed, lower case, punctuation other than ``-``/``_`` dropped,
    each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    """Link targets outside fenced code blocks; a link whose text is inline code is still a link."""
    text = FENCE.sub("", path.read_text())
    return LINK.findall(text)


def _broken(path: Path) -> list[str]:
    bad = []
    for target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
        elif anchor and dest.suffix != ".md":
            bad.append(f"{target}: an anchor into a file that is not markdown")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path):
    bad = _broken(path)
    assert not bad, f"{path.relative_to(REPO)}: broken links: {bad}"


def test_the_checker_sees_a_broken_file_and_anchor(tmp_path):
    """The check itself fails on a missing file and a missing heading (so a pass above means something)."""
    (tmp_path / "b.md").write_text("# Real heading: one (two)\n\n## Preference tuning (DPO)\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#real-heading-one-two) [ok2](b.md#preference-tuning-dpo) [`x`](b.md)\n"
                   "[gone](c.md) [no anchor](b.md#nope) [web](https://example.com/x)\n"
                   "```\n[in code](nowhere.md)\n```\n")
    assert _broken(doc) == ["c.md: no such file", "b.md#nope: no heading #nope in b.md"]


def test_the_plan_doc_names_every_shape_preset():
    """docs/plan.md's list of the presets ``plan=true`` takes is every one the code has (it had lost the three
    mixtures of experts while the launcher's error listed them), and only those."""
    from npu_train.model.presets import preset_names

    text = (REPO / "docs" / "plan.md").read_text()
    listed = re.search(r"\(presets:\s*(.*?); any HF dir", text, flags=re.S)
    assert listed, "docs/plan.md lost its '(presets: ...; any HF dir' list"
    assert sorted(set(re.findall(r"`([\w.\-]+)`", listed.group(1)))) == preset_names()
