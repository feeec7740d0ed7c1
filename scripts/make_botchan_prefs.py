"""Regenerate src/npu_train/data/assets/botchan_prefs.jsonl, the shipped preference set, from the Botchan text.

Rule (documented in src/npu_train/data/assets/SOURCE.md): the Gutenberg-stripped text
(``npu_train.data.botchan_text()``) is cut into paragraphs and sentences exactly as
``scripts/make_botchan_chat.py`` does. For sentences k and k+1 of the same paragraph, k odd (1, 3, 5, ...;
the even ones make botchan-chat), sentence k 30 to 160 characters, sentence k+1 40 to 120 characters and
at least 10 words, one conversational preference row is written:
``{"prompt": [{"role": "user", "content": "Continue the story: <sentence k>"}],
"chosen": [{"role": "assistant", "content": "<sentence k+1>"}],
"rejected": [{"role": "assistant", "content": "<the words of sentence k+1, shuffled>"}]}``.
The shuffle is deterministic and needs no random generator: the words are sorted by
``sha256(f"{row}:{position}:{word}")`` (``row`` the 0-based row number); if that leaves them in their
original order they are rotated by one. Each word keeps its capital letter and punctuation, so the
rejected answer is the same bag of words (and of tokens, nearly) in a wrong order.

Usage: PYTHONPATH=src python scripts/make_botchan_prefs.py [out.jsonl]
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from npu_train.data import botchan_text

# a sentence ends after . ! or ? (plus an optional closing quote) followed by whitespace (as botchan-chat)
_SENT_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+")
MIN_WORDS = 10


def shuffled(sentence: str, row: int) -> str:
    """The words of ``sentence`` in a deterministic order other than the original."""
    words = sentence.split()
    order = sorted(range(len(words)),
                   key=lambda i: hashlib.sha256(f"{row}:{i}:{words[i]}".encode()).hexdigest())
    if order == sorted(order):
        order = order[1:] + order[:1]
    return " ".join(words[i] for i in order)


def rows() -> list[dict]:
    out = []
    for para in re.split(r"\n\s*\n", botchan_text()):
        para = " ".join(para.split())
        sents = [s.strip() for s in _SENT_END.split(para) if s.strip()]
        for k in range(1, len(sents) - 1, 2):
            a, b = sents[k], sents[k + 1]
            if 30 <= len(a) <= 160 and 40 <= len(b) <= 120 and len(b.split()) >= MIN_WORDS:
                out.append({"prompt": [{"role": "user", "content": f"Continue the story: {a}"}],
                            "chosen": [{"role": "assistant", "content": b}],
                            "rejected": [{"role": "assistant", "content": shuffled(b, len(out))}]})
    return out


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else
               Path(__file__).resolve().parents[1] / "src/npu_train/data/assets/botchan_prefs.jsonl")
    rs = rows()
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for r in rs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{out}: {len(rs)} rows")


if __name__ == "__main__":
    main()
