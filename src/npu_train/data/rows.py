"""Stage 1 of :mod:`npu_train.data.prepare`, part 2: the validated rows of each ``data.format``.

Rows are read from a :mod:`~npu_train.data.sources` source (a built-in set, files, globs, directories,
``save_to_disk`` directories) one batch at a time and checked; a bad row is an error naming ``file:row``
(``data.bad_rows=refuse``) or is counted and dropped (``skip``).

- ``text``: documents in pieces, :func:`~npu_train.data.sources.text_pieces`.
- ``chat``: ``{"messages": [{"role", "content"}, ...]}`` (at least one non-empty assistant message);
  ``prompt_completion``: ``{"prompt", "completion"}`` as a user / assistant pair: :func:`iter_rows` gives
  each row's messages.
- ``preference``: TRL's three preference formats, detected per file from its columns and per row from the
  value types (:func:`iter_pairs` gives a :class:`PairText` per row):

  - standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
  - conversational: ``prompt`` / ``chosen`` / ``rejected`` message lists (``[{"role", "content"}]``);
  - implicit prompt: no prompt column; ``chosen`` and ``rejected`` are both strings or both conversations
    sharing a prefix. Conversations: the prompt is the common leading messages; strings: the longest common
    character prefix, less a trailing space (which moves to the completions, as TRL's ``extract_prompt``).

  A row with a missing / mistyped field, an unknown role, an empty completion, an empty prompt, no common
  prefix or chosen equal to rejected is a bad row.

The rows stage knows no tokenizer: rendering them is the next stage (:mod:`npu_train.data.render`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from npu_train.config import DATA_FORMATS

from .sources import BAD_ROWS, BadRows, Source, iter_converted, no_rows, resolve_source
from .text import DataError

__all__ = ["FIELDS", "FORMATS", "PAIR_FIELDS", "ROLES", "PairText", "iter_pairs", "iter_rows", "read_rows",
           "row_messages", "row_pair"]

FORMATS = DATA_FORMATS  # data.format values (their home: npu_train.config)
ROLES = ("system", "user", "assistant")


# ------------------------------------------------------------------------------- chat / prompt_completion
def _shape_hint(fmt: str) -> str:
    if fmt == "chat":
        return '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
    return '{"prompt": "...", "completion": "..."}'


def row_messages(obj, fmt: str, where: str) -> list[dict]:
    """The validated ``messages`` of one JSONL row (``prompt_completion``: user + assistant);
    :class:`DataError` naming ``where`` (``file:line``) otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object like {_shape_hint(fmt)}, got {type(obj).__name__}")
    if fmt == "prompt_completion":
        for k in ("prompt", "completion"):
            if not isinstance(obj.get(k), str):
                got = "missing" if k not in obj else type(obj[k]).__name__
                raise DataError(f"{where}: field {k!r} must be a string ({got}); data.format=prompt_completion "
                                f"rows look like {_shape_hint(fmt)}")
        if not obj["completion"].strip():
            raise DataError(f"{where}: empty 'completion': nothing to train on; remove the row")
        return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        got = "missing" if "messages" not in obj else f"a {type(msgs).__name__}"
        raise DataError(f"{where}: 'messages' is {got}; data.format=chat rows look like {_shape_hint(fmt)}")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{k}] must be an object with a string 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: messages[{k}] has unknown role {role!r}; use one of {list(ROLES)}")
        out.append({"role": role, "content": m["content"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise DataError(f"{where}: no non-empty assistant message: nothing to train on; add one or remove the row")
    return out


#: the columns a row of each format needs (data.*_field maps them to the source's columns)
FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
          "preference": ("prompt", "chosen", "rejected")}


def iter_rows(spec: str, fmt: str, fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
              log: Callable[[str], None] = print, bad: Optional[BadRows] = None) -> Iterator[tuple[list[dict], str]]:
    """``(messages, "file:row")`` of each good row of a chat / prompt_completion source in file order, one
    at a time (memory: one batch of rows): a built-in name (``botchan-chat``), a JSON(L) /
    parquet / arrow file, a glob or directory of them, or a save_to_disk directory (``split``). ``fields``
    maps ``messages`` / ``prompt`` / ``completion`` to the source's column names. A bad row is an error
    naming it (``bad_rows="refuse"``) or is counted (in ``bad`` when given), reported through ``log`` with
    the first one after the last row, and dropped (``"skip"``). No good row at all: :class:`DataError` after
    the last row (saying whether the rows were all bad or there were none). Raises FileNotFoundError /
    :class:`DataError`."""
    src = resolve_source(spec, fmt, split)
    names = {k: str((fields or {}).get(k) or k) for k in FIELDS[fmt]}

    def convert(b, i):
        obj = {k: b.columns[c][i] for k, c in names.items() if b.columns[c][i] is not None}
        return row_messages(obj, fmt, b.where(i)), b.where(i)

    n, bad = 0, bad if bad is not None else BadRows()
    for row in iter_converted(src, list(dict.fromkeys(names.values())), split, convert, bad_rows, log, bad=bad):
        n += 1
        yield row
    if not n:
        raise no_rows(spec, f" (split {split!r})" if src.kind == "saved" else "", bad, _shape_hint(fmt))


def read_rows(spec: str, fmt: str, fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
              log: Callable[[str], None] = print) -> list[tuple[list[dict], str]]:
    """:func:`iter_rows` as a list (small sources and tests; :func:`~npu_train.data.prepare.build_sft_data`
    streams)."""
    return list(iter_rows(spec, fmt, fields, bad_rows, split, log))


# ------------------------------------------------------------------------------- preference pairs
#: the columns of a preference row (data.prompt_field / chosen_field / rejected_field rename them)
PAIR_FIELDS = ("prompt", "chosen", "rejected")


_SHAPES = ('{"prompt": "...", "chosen": "...", "rejected": "..."}, the same with message lists '
           '[{"role": "user", "content": "..."}], or {"chosen": ..., "rejected": ...} sharing a prompt prefix')


Text = Union[str, list]


@dataclass(frozen=True)
class PairText:
    """One validated row: ``chat`` False: strings; True: message lists (``prompt`` the leading messages,
    ``chosen`` / ``rejected`` the messages that follow it). ``where``: ``file:row``."""

    chat: bool
    prompt: Text
    chosen: Text
    rejected: Text
    where: str


def _bad(where: str, why: str) -> DataError:
    return DataError(f"{where}: {why}")


def _messages(v, name: str, where: str) -> list[dict]:
    out = []
    for k, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise _bad(where, f"{name}[{k}] must be an object with a string 'content'")
        if m.get("role") not in ROLES:
            raise _bad(where, f"{name}[{k}] has unknown role {m.get('role')!r}; use one of {list(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _common_prefix(chosen: Text, rejected: Text) -> int:
    """Length of the common leading part (characters or messages); a string prefix ending in a space stops
    before it (the space starts the completions, as TRL's ``extract_prompt``)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n < min(len(chosen), len(rejected)) and n and chosen[n - 1] == " ":
        n -= 1
    return n


def _empty(v: Text) -> bool:
    return not v.strip() if isinstance(v, str) else not any(m["content"].strip() for m in v)


def row_pair(obj: dict, has_prompt: bool, where: str) -> PairText:
    """The :class:`PairText` of one row (``obj``: field -> value, a missing field absent or None; ``has_prompt``:
    the source has a prompt column, else the prompt is implicit). Raises :class:`DataError` naming ``where``."""
    keys = PAIR_FIELDS if has_prompt else PAIR_FIELDS[1:]
    vals = [obj.get(k) for k in keys]
    for k, v in zip(keys, vals):
        if not isinstance(v, (str, list)):
            got = "missing" if v is None else f"a {type(v).__name__}"
            raise _bad(where, f"field {k!r} is {got}; data.format=preference rows look like {_SHAPES}")
    chat = isinstance(vals[-1], list)
    if any(isinstance(v, list) != chat for v in vals):
        raise _bad(where, f"fields {list(keys)} mix strings and message lists; use all strings or all lists")
    if chat:
        vals = [_messages(v, k, where) for k, v in zip(keys, vals)]
    if has_prompt:
        prompt, chosen, rejected = vals
    else:
        chosen, rejected = vals
        if chosen == rejected:
            raise _bad(where, "chosen and rejected are identical: nothing to prefer; remove the row")
        n = _common_prefix(chosen, rejected)
        if n == 0:
            raise _bad(where, "chosen and rejected share no prefix, so there is no implicit prompt; add a "
                              "'prompt' column (data.prompt_field) or remove the row")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if chosen == rejected:
        raise _bad(where, "chosen and rejected are identical: nothing to prefer; remove the row")
    for k, v in (("chosen", chosen), ("rejected", rejected)):
        if _empty(v):
            raise _bad(where, f"empty {k!r} completion (after the prompt): nothing to compare; remove the row")
    if not prompt:
        raise _bad(where, "empty 'prompt': the first completion token needs a token before it; add a prompt")
    return PairText(chat, prompt, chosen, rejected, where)


def iter_pairs(spec: str, fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
               log: Callable[[str], None] = print, bad: Optional[BadRows] = None) -> Iterator[PairText]:
    """The validated rows of ``spec`` in file order, one at a time (memory: one batch of rows); bad rows
    skipped (``bad_rows="skip"``) are counted in ``bad`` and reported through ``log`` with the first one after
    the last row (``"refuse"``: the first is an error). ``fields`` maps prompt / chosen / rejected to the
    source's columns; a file without the prompt column has implicit prompts. No usable row: a
    :class:`DataError` after the last row. Raises FileNotFoundError / :class:`DataError`."""
    src = resolve_source(spec, "preference", split)
    names = {k: str((fields or {}).get(k) or k) for k in PAIR_FIELDS}
    cols = list(dict.fromkeys([names["chosen"], names["rejected"], names["prompt"]]))

    def convert(b, i):
        obj = {k: b.columns[c][i] for k, c in names.items() if c in b.columns}
        return row_pair(obj, names["prompt"] in b.columns, b.where(i))

    n, bad = 0, bad if bad is not None else BadRows()
    for pair in iter_converted(src, cols, split, convert, bad_rows, log, optional=(names["prompt"],), bad=bad):
        n += 1
        yield pair
    if not n:
        raise no_rows(spec, f" (split {split!r})" if src.kind == "saved" else "", bad, _SHAPES)


def data_settings(d) -> tuple[str, str, str, Optional[str]]:
    """``(format, bad_rows, split, val_split)`` of the ``cfg.data`` section ``d``, with their defaults. Raises
    :class:`DataError` for an unknown ``data.format`` or ``data.bad_rows``."""
    fmt = str(getattr(d, "format", "text") or "text")
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r}: use one of {list(FORMATS)}")
    bad_rows = str(getattr(d, "bad_rows", "refuse") or "refuse")
    if bad_rows not in BAD_ROWS:
        raise DataError(f"data.bad_rows={bad_rows!r}: use one of {list(BAD_ROWS)}")
    return fmt, bad_rows, str(getattr(d, "split", None) or "train"), getattr(d, "val_split", None) or None


def check_data_source(cfg) -> Source:
    """Before the plan and the start-up's timings: ``data.format``, ``data.bad_rows`` and ``data.source`` name
    something that exists (a built-in set of the format, a file, a glob matching files, a directory of them,
    a save_to_disk directory with the splits asked for); nothing is read. Raises FileNotFoundError (a missing
    path: one line naming the built-in sets and the accepted paths) or :class:`DataError`."""
    fmt, _, split, val_split = data_settings(cfg.data)
    return resolve_source(cfg.data.source, fmt, split, val_split)
