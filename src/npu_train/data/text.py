"""The shipped text ``"botchan"`` (Project Gutenberg #8868, header/footer stripped), :class:`DataError` and
strict UTF-8 decoding. Reading sources is :mod:`npu_train.data.sources`."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from npu_train.errors import UserError

__all__ = [
    "DataError",
    "strip_gutenberg",
    "botchan_text",
    "decode_utf8",
    "BUILTIN_SOURCES",
]

BUILTIN_SOURCES = ("botchan",)

# "*** START OF THIS PROJECT GUTENBERG EBOOK ... ***" / "*** END OF THE PROJECT GUTENBERG EBOOK ... ***"
# (the FULL LICENSE section's "*** START: FULL LICENSE ***" has no "OF" and never matches).
_START_RE = re.compile(r"^\*\*\*\s*START OF\b.*\*\*\*[ \t]*\r?$", re.MULTILINE | re.IGNORECASE)
_END_RE = re.compile(r"^\*\*\*\s*END OF\b.*\*\*\*[ \t]*\r?$", re.MULTILINE | re.IGNORECASE)
# Older e-texts repeat the title as a last body line: "End of Project Gutenberg's <title>, by <author>".
_END_LINE_RE = re.compile(r"\n[ \t]*End of (the )?Project Gutenberg\S*\s[^\n]*\s*\Z", re.IGNORECASE)


class DataError(UserError, ValueError):
    """The training data cannot be used as given; the message says how to fix it."""


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header and footer (the ``*** START/END OF ... ***`` markers) and a
    leading BOM; a text without the markers is returned unchanged."""
    if text.startswith("\ufeff"):
        text = text[1:]
    start = _START_RE.search(text)
    end = _END_RE.search(text, start.end() if start else 0)
    if start is None and end is None:
        return text
    body = text[start.end() if start else 0 : end.start() if end else len(text)].strip()
    return _END_LINE_RE.sub("", body).rstrip()


def botchan_text() -> str:
    """The embedded novel *Botchan*, Gutenberg header/footer stripped, LF line endings."""
    raw = resources.files("npu_train.data").joinpath("assets", "botchan.txt").read_bytes()
    text = raw.decode("utf-8-sig")
    return strip_gutenberg(text.replace("\r\n", "\n"))


def decode_utf8(raw: bytes, path: Path) -> str:
    """``raw`` as strict UTF-8 (a leading BOM dropped); :class:`DataError` naming byte offset, line and the fix."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        bad = raw[e.start : e.start + 4]
        raise DataError(
            f"{path}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {e.start}, "
            f"line {line}, near {bad!r}); re-encode as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > {path.with_suffix('.utf8' + path.suffix)}"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text
