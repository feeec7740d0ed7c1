"""Preference pairs (``data.format=preference``) for DPO: chosen / rejected completions of one prompt.

Rows of a source (any :mod:`~npu_train.data.sources` source; ``data.prompt_field`` / ``data.chosen_field`` /
``data.rejected_field`` name the columns) in TRL's three preference formats, detected per file from its
columns and per row from the value types:

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``: plain text, no chat template. Prompt
  ids = the special tokens the tokenizer puts before a text (a BOS, if its post-processor adds one) +
  ``tokenize(prompt)``; completion ids = ``tokenize(chosen) + [eos]`` (likewise rejected), each text
  tokenized on its own as TRL's ``DPOTrainer`` does.
- conversational: ``prompt`` / ``chosen`` / ``rejected`` message lists (``[{"role", "content"}]``):
  ``P = render(prompt, add_generation_prompt=True)`` with the model's chat template; the completion is the
  text of ``render(prompt + chosen)`` after ``P`` (a template where ``P`` is not a prefix of that is an
  error naming the row); prompt ids = ``tokenize(P)``, completion ids = ``tokenize(suffix)``.
- implicit prompt: no prompt column; ``chosen`` and ``rejected`` are both strings or both conversations
  sharing a prefix. Conversations: the prompt is the common leading messages; strings: the longest common
  character prefix, less a trailing space (which moves to the completions, as TRL's ``extract_prompt``);
  then as above.

A row with a missing / mistyped field, an unknown role, an empty completion, an empty prompt, no common
prefix or chosen equal to rejected is a bad row (``data.bad_rows``: refuse names it, skip counts it).

Layout (:class:`~npu_train.data.dataset.PackedData` with ``pairs=True``): one sequence per row,
``seq_len + 1`` tokens, right-padded with ``pad_id``; row ``2i`` is prompt + chosen and row ``2i + 1`` prompt +
rejected of pair ``i``, in train and validation (the last ``val_fraction`` of the pairs, at least one when
> 0; or, with ``val_split``, the pairs of that split of a ``save_to_disk`` DatasetDict, ``val_fraction`` unused). Labels (int64): the token id at every completion position, ``IGNORE_INDEX`` on the prompt and the
padding (:func:`~npu_train.data.dataset.micro_batch_tensors` shifts them into next-token targets).
Truncation: the prompt is kept whole and each completion is cut to the ``seq_len + 1 - len(prompt)`` tokens
left; a pair whose prompt leaves no completion token is dropped. Start at :func:`build_preference_data`."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from npu_train.model.llama import IGNORE_INDEX

from .chat import ROLES, ChatRenderer
from .dataset import PackedData, load_packed, n_val_rows, packed_cache_path, save_packed, tokenizer_hash
from .sources import convert_rows, resolve_source, source_key
from .text import DataError

__all__ = ["PAIR_FIELDS", "PairText", "PairTokens", "build_preference_data", "pair_tokens", "preference_fingerprint",
           "read_pairs", "row_pair"]

#: the columns of a preference row (data.prompt_field / chosen_field / rejected_field rename them)
PAIR_FIELDS = ("prompt", "chosen", "rejected")
_FORMAT = "npu-train-pref-v1"
#: how rows are truncated (part of the cache key)
_TRUNCATION = "keep-prompt-cut-completion"
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


@dataclass
class PairTokens:
    """Token ids (unpadded, untruncated) of one pair: the shared ``prompt`` and the two completions."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    where: str


# ------------------------------------------------------------------------------- validating rows
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


def read_pairs(spec: str, fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
               log: Callable[[str], None] = print) -> tuple[list[PairText], int]:
    """``(pairs, n_bad)``: the validated rows of ``spec`` in file order and how many bad rows were skipped
    (``bad_rows="skip"``; reported through ``log`` with the first one; ``"refuse"``: the first is an error).
    ``fields`` maps prompt / chosen / rejected to the source's columns; a file without the prompt column has
    implicit prompts. Raises FileNotFoundError / :class:`DataError`."""
    src = resolve_source(spec, "preference", split)
    names = {k: str((fields or {}).get(k) or k) for k in PAIR_FIELDS}
    cols = list(dict.fromkeys([names["chosen"], names["rejected"], names["prompt"]]))

    def convert(b, i):
        obj = {k: b.columns[c][i] for k, c in names.items() if c in b.columns}
        return row_pair(obj, names["prompt"] in b.columns, b.where(i))

    out, n_bad = convert_rows(src, cols, split, convert, bad_rows, log, optional=(names["prompt"],))
    if not out:
        where = f" (split {split!r})" if src.kind == "saved" else ""
        raise DataError(f"data.source={spec!r}{where}: no usable preference rows; add rows like {_SHAPES}")
    return out, n_bad


# ------------------------------------------------------------------------------- tokenizing
def lead_ids(tokenizer) -> list[int]:
    """The special tokens ``tokenizer`` puts before a text when asked to add them (a BOS), else []."""
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k])
    return []


def _render(renderer: ChatRenderer, msgs: list[dict], where: str, gen: bool) -> str:
    try:
        return renderer.render(msgs, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles)
        raise DataError(f"{where}: the chat template could not render this row "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None


def _chat_tokens(renderer: ChatRenderer, p: PairText) -> PairTokens:
    if renderer.template is None:
        raise DataError(f"{p.where}: the model has no chat template, so conversational preference rows cannot be "
                        "rendered; use a chat model or string rows {\"prompt\", \"chosen\", \"rejected\"}")
    head = _render(renderer, p.prompt, p.where, True)
    comps = []
    for name, c in (("chosen", p.chosen), ("rejected", p.rejected)):
        full = _render(renderer, p.prompt + c, p.where, False)
        if not full.startswith(head):
            raise DataError(f"{p.where}: the chat template renders the prompt differently when the {name} answer "
                            "follows (the prompt rendered with add_generation_prompt=True is not a prefix of "
                            "prompt + answer), so prompt and completion cannot be split; use string rows or a "
                            "template without that")
        comps.append(renderer.tok.encode(full[len(head):], add_special_tokens=False).ids)
    return PairTokens(list(renderer.tok.encode(head, add_special_tokens=False).ids), comps[0], comps[1], p.where)


def pair_tokens(renderer: ChatRenderer, p: PairText, lead: Optional[list[int]] = None) -> PairTokens:
    """Token ids of one validated pair (see the module doc); ``lead``: :func:`lead_ids` of the tokenizer
    (computed when None). Raises :class:`DataError` naming the row (no template / EOS, template errors)."""
    if p.chat:
        return _chat_tokens(renderer, p)
    if renderer.eos_id is None:
        raise DataError(f"{p.where}: the model has no EOS token to end string completions; use conversational rows")
    tok = renderer.tok
    lead = lead_ids(tok) if lead is None else lead
    eos = [int(renderer.eos_id)]
    return PairTokens(list(lead) + tok.encode(p.prompt, add_special_tokens=False).ids,
                      tok.encode(p.chosen, add_special_tokens=False).ids + eos,
                      tok.encode(p.rejected, add_special_tokens=False).ids + eos, p.where)


# ------------------------------------------------------------------------------- building
def preference_fingerprint(src_key: str, renderer: ChatRenderer, seq_len: int, val_fraction: Optional[float],
                           pad_id: int, fields: Optional[dict] = None) -> str:
    """sha256 hex cache key over the source's cheap key (with the split names), the column mapping, the format
    and truncation rule, the chat template, tokenizer, EOS and the sequence knobs; ``val_fraction`` None:
    validation is a split (``val_fraction`` not used, not in the key)."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\nformat preference\ntruncation {_TRUNCATION}\nsource {src_key}\n".encode())
    h.update(f"fields {json.dumps(fields or {}, sort_keys=True)}\n".encode())
    h.update(f"template {renderer.template!r}\ntokenizer {tokenizer_hash(renderer.tok)}\neos {renderer.eos_id}\n"
             .encode())
    vf = "split" if val_fraction is None else repr(float(val_fraction))
    h.update(f"seq_len {int(seq_len)}\nval_fraction {vf}\npad {pad_id}\n".encode())
    return h.hexdigest()


def _lay_pairs(pairs: list[PairTokens], row: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)``, each ``[2 * len(pairs), row]`` int64: rows ``2i`` / ``2i + 1`` prompt + chosen / rejected
    of pair ``i`` (completions already fit), right-padded with ``pad_id``; labels the completion ids, else
    ``IGNORE_INDEX``."""
    ids = torch.full((2 * len(pairs), row), pad_id, dtype=torch.int64)
    lab = torch.full((2 * len(pairs), row), IGNORE_INDEX, dtype=torch.int64)
    for i, p in enumerate(pairs):
        n = len(p.prompt)
        for r, comp in ((2 * i, p.chosen), (2 * i + 1, p.rejected)):
            ids[r, :n] = torch.tensor(p.prompt, dtype=torch.int64)
            ids[r, n:n + len(comp)] = torch.tensor(comp, dtype=torch.int64)
            lab[r, n:n + len(comp)] = torch.tensor(comp, dtype=torch.int64)
    return ids, lab


def _fit(pairs: list[PairTokens], row: int, vocab_size: Optional[int]) -> tuple[list[PairTokens], int, int, int]:
    """``(kept, n_cut, n_dropped, n_tokens)``: pairs with completions cut to the room the prompt leaves in
    ``row`` tokens; pairs whose prompt leaves no room dropped; ids checked ``< vocab_size``."""
    kept, n_cut, n_drop, n_tokens = [], 0, 0, 0
    for p in pairs:
        room = row - len(p.prompt)
        if room < 1:
            n_drop += 1
            continue
        n_cut += (len(p.chosen) > room) + (len(p.rejected) > room)
        q = PairTokens(p.prompt, p.chosen[:room], p.rejected[:room], p.where)
        top = max(q.prompt + q.chosen + q.rejected)
        if vocab_size is not None and top >= vocab_size:
            raise DataError(f"{p.where}: tokenizer produced id {top} but the model's vocabulary has {vocab_size} "
                            "entries: the tokenizer does not match the model")
        n_tokens += 2 * len(q.prompt) + len(q.chosen) + len(q.rejected)
        kept.append(q)
    return kept, n_cut, n_drop, n_tokens


def _cached(cache_path, fp: str) -> Optional[PackedData]:
    if cache_path is None or not cache_path.is_file():
        return None
    try:
        data = load_packed(cache_path)
    except Exception:  # noqa: BLE001 - unreadable cache: rebuild
        return None
    ok = data.fingerprint == fp and data.pairs and data.train_labels is not None
    return data if ok else None


def build_preference_data(spec: str, renderer: ChatRenderer, seq_len: int, val_fraction: float = 0.05,
                          pad_id: int = 0, cache_dir: str | os.PathLike | None = None,
                          vocab_size: Optional[int] = None, log: Callable[[str], None] = print,
                          fields: Optional[dict] = None, bad_rows: str = "refuse",
                          split: str = "train", val_split: Optional[str] = None) -> PackedData:
    """Read, tokenize, truncate and pad the preference rows of ``spec`` into a :class:`PackedData` with
    ``pairs=True`` (see the module doc for the layout): ``train`` / ``val`` ``[2 * pairs, seq_len + 1]`` int64
    ids, ``train_labels`` / ``val_labels`` the same shape, int64 (completion ids, else ``IGNORE_INDEX``),
    positions None. Cached under ``cache_dir`` keyed by :func:`preference_fingerprint`. ``fields`` maps
    prompt / chosen / rejected to the source's columns, ``bad_rows`` refuse | skip, ``split`` the
    save_to_disk split, ``val_split`` a split of the same DatasetDict read as the validation pairs
    (``val_fraction`` then unused); ``log`` gets one summary line. Raises :class:`DataError` for bad rows
    (naming file and row), ids outside ``vocab_size``, or fewer than 2 usable pairs (with ``val_split``: no
    usable pair in one of the splits); FileNotFoundError."""
    seq_len = int(seq_len)
    row = seq_len + 1
    val_split = str(val_split) if val_split else None
    fp = preference_fingerprint(source_key(resolve_source(spec, "preference", split, val_split)), renderer,
                                seq_len, None if val_split else val_fraction, int(pad_id), fields)
    cache_path = packed_cache_path(cache_dir, fp) if cache_dir is not None else None
    data = _cached(cache_path, fp)
    if data is not None:
        log(f"data: {(data.n_train + data.n_val) // 2} preference pairs from {spec} (cached)")
        return data
    lead = lead_ids(renderer.tok)
    splits = [split] + ([val_split] if val_split else [])
    per = []  # per split: (kept pairs, rows read)
    n_bad = n_cut = n_drop = n_tokens = 0
    for name in splits:
        texts, bad = read_pairs(spec, fields, bad_rows, name, log)
        pairs, cut, drop, tokens = _fit([pair_tokens(renderer, p, lead) for p in texts], row, vocab_size)
        per.append((pairs, len(texts) + bad))
        n_bad, n_cut, n_drop, n_tokens = n_bad + bad, n_cut + cut, n_drop + drop, n_tokens + tokens
    kept = sum(len(p) for p, _ in per)
    msg = (f"data: {kept} of {sum(n for _, n in per)} preference pairs kept"
           + (f" ({n_bad} bad rows skipped)" if n_bad else "")
           + (f" ({len(per[0][0])} of {per[0][1]} from split {split!r} for training, {len(per[1][0])} of "
              f"{per[1][1]} from split {val_split!r} for validation; data.val_fraction not used)" if val_split else "")
           + f"; {n_cut} completions truncated to fit seq_len+1={row} tokens (the prompt is kept)"
           + f"; {n_drop} pair(s) dropped (the prompt alone fills the {row} tokens)")
    if val_split:
        for (got, _), name in zip(per, splits):
            if not got:
                log(msg)
                raise DataError(f"no usable preference pair in split {name!r} of {spec} (train and validation "
                                f"need one each); raise data.seq_len (now {seq_len}) so the prompts fit, or add "
                                "rows to that split")
        train_p, val_p = per[0][0], per[1][0]
    else:
        if kept < 2:
            log(msg)
            raise DataError(f"only {kept} usable preference pairs in {spec} (need 2: train and validation); raise "
                            f"data.seq_len (now {seq_len}) so the prompts fit, or add rows")
        pairs = per[0][0]
        n_val = n_val_rows(kept, float(val_fraction))
        train_p, val_p = pairs[: kept - n_val], pairs[kept - n_val:]
    train = _lay_pairs(train_p, row, int(pad_id))
    val = _lay_pairs(val_p, row, int(pad_id))
    log(msg + f"; {len(train_p)} train / {len(val_p)} validation pairs, one sequence per answer "
        f"({n_tokens / (2 * kept * row):.0%} filled)")
    data = PackedData(train=train[0], val=val[0], seq_len=seq_len, n_tokens=n_tokens, fingerprint=fp,
                      train_labels=train[1], val_labels=val[1], pairs=True)
    if cache_path is not None:
        save_packed(data, cache_path)
    return data
