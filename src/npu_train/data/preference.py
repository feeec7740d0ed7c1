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
> 0; or, with ``val_split``, the pairs of that split of a ``save_to_disk`` DatasetDict, ``val_fraction``
unused). Labels: the token id at every completion position, ``IGNORE_INDEX`` on the prompt and the padding,
stored as a uint8 mask (:func:`~npu_train.data.dataset.micro_batch_tensors` shifts them into next-token
targets). Truncation: the prompt is kept whole and each completion is cut to the ``seq_len + 1 -
len(prompt)`` tokens left; a pair whose prompt leaves no completion token is dropped.

The build streams like the SFT one (:mod:`npu_train.data.sft`): pass 1 tokenizes pair after pair into flat
temporary files (prompt, chosen and rejected ids back to back, per pair the three lengths and the largest
id); pass 2 writes the rows block by block into the memory-mapped packed file, built once under the cache
lock. Errors come in the order of a build that read every row, then tokenized every pair, then checked
the ids. Start at :func:`build_preference_data`."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import numpy as np

from .chat import ROLES, ChatRenderer
from .dataset import (PROGRESS_S, PackedData, PackedFileWriter, build_cached, load_packed, packed_meta,
                      read_losses, space_hint, token_dtype, tokenizer_hash)
from .sources import BadRows, iter_converted, no_rows, resolve_source, source_key
from .spool import (BuildJob, BuildProgress, SampleSpool, segment_indices, split_max, train_val_ranges,
                    when_built)
from .text import DataError

__all__ = ["BLOCK_TOKENS", "PAIR_FIELDS", "PairText", "PairTokens", "build_preference_data", "iter_pairs",
           "pair_tokens", "preference_fingerprint", "row_pair"]

#: the columns of a preference row (data.prompt_field / chosen_field / rejected_field rename them)
PAIR_FIELDS = ("prompt", "chosen", "rejected")
_FORMAT = "npu-train-pref-v1"
#: how rows are truncated (part of the cache key)
_TRUNCATION = "keep-prompt-cut-completion"
#: row tokens (padding included) laid out per block written in pass 2
BLOCK_TOKENS = 1 << 18
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


def _cached(path: Path, fp: str) -> Optional[PackedData]:
    """The packed file at ``path`` when it holds preference pairs for ``fp``, else None."""
    try:
        data = load_packed(path)
    except Exception:  # noqa: BLE001 - unreadable cache: rebuild
        return None
    ok = data.fingerprint == fp and data.pairs and data.train_labels is not None
    return data if ok else None


def build_preference_data(spec: str, renderer: ChatRenderer, seq_len: int, val_fraction: float = 0.05,
                          pad_id: int = 0, cache_dir: str | os.PathLike | None = None,
                          vocab_size: Optional[int] = None, log: Callable[[str], None] = print,
                          fields: Optional[dict] = None, bad_rows: str = "refuse",
                          split: str = "train", val_split: Optional[str] = None,
                          progress_s: float = PROGRESS_S) -> PackedData:
    """Read, tokenize, truncate and pad the preference rows of ``spec`` into a memory-mapped :class:`PackedData`
    with ``pairs=True`` (see the module doc for the layout): ``train`` / ``val`` ``[2 * pairs, seq_len + 1]``
    uint16 / uint32 ids, ``train_labels`` / ``val_labels`` the same shape, a uint8 mask (1 on the completion
    tokens: labels = ids there, else ``IGNORE_INDEX``), positions None. Cached under ``cache_dir`` keyed by
    :func:`preference_fingerprint` (else a temporary file, unlinked once mapped). ``fields`` maps prompt /
    chosen / rejected to the source's columns, ``bad_rows`` refuse | skip, ``split`` the save_to_disk split,
    ``val_split`` a split of the same DatasetDict read as the validation pairs (``val_fraction`` then
    unused); ``log`` gets one summary line (and a progress line every ``progress_s`` seconds of a long
    build). Raises :class:`DataError` for bad rows (naming file and row), ids outside ``vocab_size``, or
    fewer than 2 usable pairs (with ``val_split``: no usable pair in one of the splits); FileNotFoundError."""
    seq_len = int(seq_len)
    val_split = str(val_split) if val_split else None
    fp = preference_fingerprint(source_key(resolve_source(spec, "preference", split, val_split)), renderer,
                                seq_len, None if val_split else val_fraction, int(pad_id), fields)
    job = BuildJob(spec=spec, renderer=renderer, seq_len=seq_len, val_fraction=float(val_fraction or 0.0),
                   pad_id=int(pad_id), vocab_size=vocab_size, fields=fields, bad_rows=bad_rows, split=split,
                   val_split=val_split, fingerprint=fp, where=space_hint(cache_dir))
    data, hit = build_cached(cache_dir, fp, lambda path: _cached(path, fp),
                             lambda tmp, lock: _write_pairs(job, tmp, lock, log, progress_s), log, job.where)
    if hit:
        log(f"data: {(data.n_train + data.n_val) // 2} preference pairs from {spec} (cached)"
            + when_built(read_losses(data.path), ("cut", "drop"), lambda c: _kept_note(job, c)))
    return data


@dataclass
class _PairStats:
    """Counts over the pairs read in pass 1 (summed over the splits); ``rows`` (read, bad ones included) and
    ``kept`` per split."""

    n_bad: int = 0
    first_bad: str = ""
    n_cut: int = 0
    n_drop: int = 0
    n_tokens: int = 0
    rows: list = field(default_factory=list)
    kept: list = field(default_factory=list)

    def losses(self) -> dict:
        """The counts a relaunch repeats (stored in the packed file, :func:`~npu_train.data.dataset.losses_meta`)."""
        return {"rows": sum(self.rows), "kept": sum(self.kept), "bad": self.n_bad, "first_bad": self.first_bad,
                "cut": self.n_cut, "drop": self.n_drop}


def _write_pairs(job: BuildJob, tmp: Path, lock: Optional[Path], log: Callable[[str], None],
                 progress_s: float) -> None:
    """Pass 1: tokenize the pairs of the split(s) into a :class:`SampleSpool` next to ``tmp``; pass 2: lay the
    kept pairs, two rows each, into the packed file ``tmp`` block by block."""
    progress = BuildProgress(log, job.spec, lock, progress_s)
    st = _PairStats()
    lead = lead_ids(job.renderer.tok)
    with SampleSpool(tmp.parent, tmp.name, n_meta=4) as spool:
        for name in [job.split] + ([job.val_split] if job.val_split else []):
            _spool_pairs(job, name, lead, spool, st, progress, log)
        spool.close()
        (train, val), msg = _pair_ranges(job, st, log)
        kept = sum(st.kept)
        log(msg + f"; {train[1] - train[0]} train / {val[1] - val[0]} validation pairs, one sequence per answer "
            f"({st.n_tokens / (2 * kept * job.row):.0%} filled)")
        plans = [_pair_max(spool, a, b, job.row, job.pad_id) for a, b in (train, val)]
        arrays = {}
        for split_name, (a, b), top in zip(("train", "val"), (train, val), plans):
            arrays[split_name] = (token_dtype(max(top, 0) + 1), 2 * (b - a))
            arrays[f"{split_name}_labels"] = (np.uint8, 2 * (b - a))
        meta = packed_meta(job.seq_len, st.n_tokens, job.fingerprint, max(plans), pairs=True, losses=st.losses())
        out = PackedFileWriter(tmp, job.row, arrays, meta, job.where)
        try:
            for split_name, (a, b) in zip(("train", "val"), (train, val)):
                _lay_pairs(spool, out, split_name, a, b, job, progress)
        finally:
            out.close()


def _spool_pairs(job: BuildJob, name: str, lead: list[int], spool: SampleSpool, st: _PairStats,
                 progress: BuildProgress, log: Callable[[str], None]) -> None:
    """Tokenize and fit the pairs of split ``name`` into ``spool`` (counts into ``st``). Errors come in the
    order of a build that read every row, then tokenized every pair, then checked the ids: a bad row found
    by reading first, then the first pair that fails to tokenize, then the first id outside the vocabulary
    (each raised once the split's last row is read)."""
    bad = BadRows()
    failed: Optional[Exception] = None
    out_of_vocab: Optional[DataError] = None
    rows = kept = 0
    for p in iter_pairs(job.spec, job.fields, job.bad_rows, name, log, bad):
        rows += 1
        if failed is not None:
            continue
        try:
            t = pair_tokens(job.renderer, p, lead)
        except Exception as e:  # noqa: BLE001 - raised once the split is read (see the docstring)
            failed = e
            continue
        try:
            kept += _add_pair(t, job.row, job.vocab_size, spool, st)
        except DataError as e:  # the first one is raised once the split is read, if nothing else failed
            out_of_vocab = out_of_vocab or e
        progress.step(sum(st.rows) + rows, spool.n_samples, st.n_tokens)
    if failed is not None or out_of_vocab is not None:
        raise failed or out_of_vocab
    st.rows.append(rows + bad.count)
    st.kept.append(kept)
    st.n_bad += bad.count
    st.first_bad = st.first_bad or bad.first


def _add_pair(p: PairTokens, row: int, vocab_size: Optional[int], spool: SampleSpool, st: _PairStats) -> int:
    """Spool one pair with its completions cut to the room the prompt leaves in ``row`` tokens: 1, or 0 when
    the prompt leaves no room (dropped); ids checked ``< vocab_size``; counts into ``st``."""
    room = row - len(p.prompt)
    if room < 1:
        st.n_drop += 1
        return 0
    st.n_cut += (len(p.chosen) > room) + (len(p.rejected) > room)
    chosen, rejected = p.chosen[:room], p.rejected[:room]
    top = max(p.prompt + chosen + rejected)
    if vocab_size is not None and top >= vocab_size:
        raise DataError(f"{p.where}: tokenizer produced id {top} but the model's vocabulary has {vocab_size} "
                        "entries: the tokenizer does not match the model")
    st.n_tokens += 2 * len(p.prompt) + len(chosen) + len(rejected)
    spool.add(p.prompt + chosen + rejected, (len(p.prompt), len(chosen), len(rejected), top))
    return 1


def _pair_ranges(job: BuildJob, st: _PairStats, log: Callable[[str], None]) -> tuple[tuple, str]:
    """``(((a, b) train, (a, b) validation) pair ranges of the spool, summary line)``; refuses too few usable
    pairs (logging the summary first)."""
    head, tail = _kept_note(job, st.losses())
    msg = (f"data: {head}"
           + (f" ({st.kept[0]} of {st.rows[0]} from split {job.split!r} for training, {st.kept[1]} of "
              f"{st.rows[1]} from split {job.val_split!r} for validation; data.val_fraction not used)"
              if job.val_split else "")
           + tail)
    splits = [job.split] + ([job.val_split] if job.val_split else [])
    fix = f"raise data.seq_len (now {job.seq_len}) so the prompts fit"
    unit = ("preference pair", "preference pairs")
    return train_val_ranges(st.kept, splits, job.val_fraction, job.spec, unit, fix, msg, log), msg


def _kept_note(job: BuildJob, c: dict) -> tuple[str, str]:
    """The summary's parts from the counts ``c`` (:meth:`_PairStats.losses`): ``"k of n preference pairs kept
    (b bad row(s) skipped)"`` and the ``"; ..."`` clauses on completions cut and pairs dropped."""
    head = f"{c['kept']} of {c['rows']} preference pairs kept" + (f" ({c['bad']} bad row(s) skipped)"
                                                                 if c.get("bad") else "")
    tail = (f"; {c.get('cut', 0)} completions truncated to fit seq_len+1={job.row} tokens (the prompt is kept)"
            f"; {c.get('drop', 0)} pair(s) dropped (the prompt alone fills the {job.row} tokens)")
    return head, tail


# ------------------------------------------------------------------------------- pass 2: rows
def _pair_blocks(spool: SampleSpool, a: int, b: int, row: int) -> Iterator[np.ndarray]:
    """Records of pairs ``a .. b - 1`` in blocks of about :data:`BLOCK_TOKENS` row tokens: int64 ``[k, 5]``
    (first token, prompt / chosen / rejected lengths, largest id)."""
    step = max(1, BLOCK_TOKENS // (2 * row))
    for s in range(a, b, step):
        yield spool.meta(s, min(b, s + step))


def _pair_max(spool: SampleSpool, a: int, b: int, row: int, pad_id: int) -> int:
    """The largest id in the rows of pairs ``a .. b - 1`` (padding included; -1 when none)."""
    top, padded = -1, False
    for meta in _pair_blocks(spool, a, b, row):
        top = max(top, int(meta[:, 4].max()))
        padded = padded or bool((meta[:, 1] + meta[:, 2:4].min(1) < row).any())
    return split_max(top, padded, pad_id, b - a)


def _lay_pairs(spool: SampleSpool, out: PackedFileWriter, name: str, a: int, b: int, job: BuildJob,
               progress: BuildProgress) -> None:
    """Write pairs ``a .. b - 1`` as rows ``2i`` (prompt + chosen) / ``2i + 1`` (prompt + rejected) of ``name``,
    right-padded with ``pad_id``, and ``<name>_labels`` (mask 1 on the completion tokens)."""
    row, first_row = job.row, 0
    for meta in _pair_blocks(spool, a, b, row):
        k = len(meta)
        t0 = int(meta[0, 0])
        start, lp, lc, lr = meta[:, 0] - t0, meta[:, 1], meta[:, 2], meta[:, 3]
        flat = spool.ids(t0, t0 + int(start[-1] + lp[-1] + lc[-1] + lr[-1]))
        r0 = np.arange(0, 2 * k * row, 2 * row, dtype=np.int64)  # row 2i's first element in the block
        # segments: prompt -> row 2i, chosen -> after it; prompt -> row 2i + 1, rejected -> after it
        p_src, p_dst = segment_indices(np.concatenate([start, start]), np.concatenate([lp, lp]),
                                       np.concatenate([r0, r0 + row]))
        c_src, c_dst = segment_indices(np.concatenate([start + lp, start + lp + lc]), np.concatenate([lc, lr]),
                                       np.concatenate([r0 + lp, r0 + row + lp]))
        ids = np.full((2 * k, row), job.pad_id, dtype=np.int64)
        ids.reshape(-1)[p_dst] = flat[p_src]
        ids.reshape(-1)[c_dst] = flat[c_src]
        lab = np.zeros((2 * k, row), dtype=np.uint8)
        lab.reshape(-1)[c_dst] = 1
        out.write(name, first_row, ids)
        out.write(f"{name}_labels", first_row, lab)
        first_row += 2 * k
        progress.touch()
