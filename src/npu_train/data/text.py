"""Training text sources: ``"botchan"`` (the shipped Project Gutenberg #8868, header/footer stripped), a
``.txt`` (strict UTF-8), a ``.jsonl`` of ``{"text": ...}``, or a directory of them (sorted). Start at
:func:`read_text_source` / :func:`read_documents`."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from npu_train.errors import UserError

__all__ = [
    "DataError",
    "strip_gutenberg",
    "botchan_text",
    "read_documents",
    "read_text_source",
    "decode_utf8",
    "BUILTIN_SOURCES",
]

BUILTIN_SOURCES = ("botchan",)
_TEXT_SUFFIXES = (".txt",)
_JSONL_SUFFIXES = (".jsonl",)

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


def _read_txt(path: Path) -> list[str]:
    return [decode_utf8(path.read_bytes(), path)]


def _read_jsonl(path: Path) -> list[str]:
    text = decode_utf8(path.read_bytes(), path)
    docs: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno}); "
                'each line must be a JSON object like {"text": "..."}'
            ) from None
        if not isinstance(obj, dict) or "text" not in obj:
            got = type(obj).__name__ if not isinstance(obj, dict) else f"keys {sorted(obj)[:5]}"
            raise DataError(
                f'{path}:{lineno}: expected a JSON object with a "text" field, got {got}; '
                'each line must be a JSON object like {"text": "..."}'
            )
        if not isinstance(obj["text"], str):
            raise DataError(
                f'{path}:{lineno}: the "text" field must be a string, got '
                f"{type(obj['text']).__name__}"
            )
        docs.append(obj["text"])
    return docs


def _read_file(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in _TEXT_SUFFIXES:
        return _read_txt(path)
    if suffix in _JSONL_SUFFIXES:
        return _read_jsonl(path)
    raise DataError(
        f"{path}: unsupported file type {path.suffix!r}; data.source must be 'botchan', "
        "a .txt file (UTF-8), a .jsonl file (one {\"text\": ...} object per line) or a "
        "directory of those"
    )


def read_documents(spec: str) -> list[str]:
    """The documents of ``spec`` (one per file / JSONL line), empty ones dropped, in a fixed order.
    Raises FileNotFoundError, ``DataError`` for unreadable or empty data."""
    spec = str(spec)
    if spec in BUILTIN_SOURCES:
        docs = [botchan_text()]
        where = f"built-in text {spec!r}"
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            if spec == "botchan-chat":  # the shipped chat set, named in text mode
                raise DataError("data.source=botchan-chat is the shipped chat set: add data.format=chat")
            raise FileNotFoundError(
                f"data.source={spec!r}: no such file or directory ({path.resolve()}); "
                f"use one of the built-in texts {list(BUILTIN_SOURCES)}, or a path to a "
                ".txt/.jsonl file or a directory of them"
            )
        if path.is_dir():
            files = sorted(
                (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES + _JSONL_SUFFIXES),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not files:
                raise DataError(f"{path}: directory contains no *.txt or *.jsonl files")
            docs = [d for f in files for d in _read_file(f)]
        else:
            docs = _read_file(path)
        where = str(path)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"{where}: no text (file(s) empty or whitespace only); add training text")
    return docs


def read_text_source(spec: str) -> str:
    """All text named by ``spec`` as one string (documents joined by a blank line)."""
    return "\n\n".join(read_documents(spec))
