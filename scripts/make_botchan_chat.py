"""Regenerate src/npu_train/data/assets/botchan_chat.jsonl from the shipped Botchan text.

Rule (documented in src/npu_train/data/assets/SOURCE.md): the Gutenberg-stripped text
(``npu_train.data.botchan_text()``) is cut into paragraphs at blank lines, each paragraph's
whitespace collapsed to single spaces; a paragraph is cut into sentences after ``.``, ``!`` or
``?`` (optionally followed by a closing quote) and whitespace. Sentences k and k+1 of the same
paragraph, for even k, both 30 to 200 characters long, give one row
``{"messages": [{"role": "user", "content": "Continue the story: <sentence k>"},
{"role": "assistant", "content": "<sentence k+1>"}]}``. Deterministic; no randomness.

Usage: PYTHONPATH=src python scripts/make_botchan_chat.py [out.jsonl]
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from npu_train.data import botchan_text

# a sentence ends after . ! or ? (plus an optional closing quote) followed by whitespace
_SENT_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+")


def rows() -> list[dict]:
    out = []
    for para in re.split(r"\n\s*\n", botchan_text()):
        para = " ".join(para.split())
        sents = [s.strip() for s in _SENT_END.split(para) if s.strip()]
        for k in range(0, len(sents) - 1, 2):
            a, b = sents[k], sents[k + 1]
            if 30 <= len(a) <= 200 and 30 <= len(b) <= 200:
                out.append({"messages": [{"role": "user", "content": f"Continue the story: {a}"},
                                         {"role": "assistant", "content": b}]})
    return out


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else
               Path(__file__).resolve().parents[1] / "src/npu_train/data/assets/botchan_chat.jsonl")
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for r in rows():
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{out}: {len(rows())} rows")


if __name__ == "__main__":
    main()
