"""Job-side data preparation (``data.*`` keys): :func:`prepare_data` returns the run's
:class:`~npu_train.data.packfile.PackedData`, one memory-mapped file built once and cached.

Every ``data.format`` goes down the same stages, each a module that imports no later one (a test checks it):

1. read rows: :mod:`~npu_train.data.sources` (files, ``save_to_disk`` directories, built-in sets, the cheap
   source key) and :mod:`~npu_train.data.rows` (the validated rows of each format: text documents, chat /
   prompt_completion messages, preference pairs; bad rows refused or skipped);
2. render samples: :mod:`~npu_train.data.render` (text tokenized in parallel batches; chat rows rendered
   with the chat template and labelled; preference pairs tokenized as prompt and completions);
3. pack: :mod:`~npu_train.data.pack` (+ :mod:`~npu_train.data.spool`): the samples laid into rows of
   ``seq_len + 1`` tokens (text: one stream cut into rows; chat: packed or one per row; preference: two
   padded rows per pair) and written into the packed file (:mod:`~npu_train.data.packfile`);
4. cache file with lock: :mod:`~npu_train.data.cache`: the file's key, the build lock, the rename into place;
5. batches, in the card processes: :mod:`~npu_train.data.sampler` picks rows, :mod:`~npu_train.data.batches`
   reads them.

:func:`build_packed_data` (text), :func:`build_sft_data` (chat / prompt_completion) and
:func:`build_preference_data` compose the stages and read in their order: the rows stage's iterator feeds the
render stage's, which feeds the pack stage, which writes the file the cache stage holds for it
(:func:`~npu_train.data.cache.cache_slot`: the key, the lock, the rename into place); nothing returns to an
earlier stage."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from npu_train.config import TRUNCATION
from npu_train.env import cache_dir as npt_cache_dir

from .cache import (cache_slot, cached_pairs, cached_sft, cached_text, preference_fingerprint, sft_fingerprint,
                    space_hint, text_fingerprint)
from .pack import (PROGRESS_S, SftJob, SplitStream, TextJob, free_check, pairs_kept_note, sft_kept_note,
                   write_pairs, write_sft, write_text)
from .packfile import PackedData, read_losses, token_dtype
from .render import ChatRenderer, chunk_safe, pair_tokens, rendered, token_batches
from .rows import FIELDS, FORMATS, check_data_source, iter_pairs, iter_rows
from .rows import data_settings as _data_settings
from .sources import BAD_ROWS, BadRows, Source, resolve_source, source_key, text_pieces
from .spool import BuildJob, when_built
from .text import DataError

__all__ = ["TextSpec", "build_packed_data", "build_preference_data", "build_sft_data", "check_data_source",
           "prepare_data"]


def prepare_data(cfg, model_path: str, model_cfg, log: Callable[[str], None] = print) -> PackedData:
    """Tokenize (and pack or pad) ``cfg.data.source`` once, cached under ``cache_dir("data")`` as a
    memory-mapped file built by one process at a time (another node / launch on the same cache waits), every
    format streamed (the launcher's memory does not grow with the corpus).

    ``model_cfg`` gives ``eos_token_id`` and ``vocab_size``; ``log`` gets chat sample counts. Raises
    :class:`DataError` for bad data or an unknown ``data.format`` / ``data.truncation``, FileNotFoundError."""
    from npu_train.model import chat_template, load_tokenizer, resolve_model_path, special_tokens

    d = cfg.data
    fmt, bad_rows, split, val_split = _data_settings(d)
    tok_path = resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tok = load_tokenizer(tok_path)
    cache = str(npt_cache_dir("data"))
    if fmt == "text":
        spec = TextSpec(resolve_source(d.source, "text", split, val_split),
                        str(getattr(d, "text_field", None) or "text"), bad_rows)
        data = build_packed_data(spec, tok, d.seq_len, d.val_fraction, eos_id=model_cfg.eos_token_id,
                                 cache_dir=cache, vocab_size=model_cfg.vocab_size, log=log,
                                 doc_mask=bool(getattr(d, "doc_mask", False)))
        if val_split:  # as the chat / preference summaries say it
            log(f"data: {data.n_train} training sequences from split {split!r}, {data.n_val} validation sequences "
                f"from split {val_split!r}; data.val_fraction not used")
        return data
    fields = {k: getattr(d, f"{k}_field", None) for k in FIELDS[fmt]}
    src = tok_path
    template = chat_template(tok_path)
    if template is None and tok_path != model_path:
        src, template = model_path, chat_template(model_path)
    specials = special_tokens(src)
    eos = model_cfg.eos_token_id
    renderer = ChatRenderer(tok, template, eos_id=eos, **specials)
    if fmt == "preference":
        return build_preference_data(d.source, renderer, d.seq_len, d.val_fraction,
                                     pad_id=int(eos) if eos is not None else 0, cache_dir=cache,
                                     vocab_size=model_cfg.vocab_size, log=log,
                                     fields={k: v for k, v in fields.items() if v}, bad_rows=bad_rows, split=split,
                                     val_split=val_split)
    return build_sft_data(d.source, fmt, renderer, d.seq_len, d.val_fraction,
                          truncation=str(getattr(d, "truncation", "drop") or "drop"),
                          pad_id=int(eos) if eos is not None else 0, cache_dir=cache,
                          vocab_size=model_cfg.vocab_size, log=log,
                          fields={k: v for k, v in fields.items() if v}, bad_rows=bad_rows, split=split,
                          pack=bool(getattr(d, "pack", True)), val_split=val_split)


# ----------------------------------------------------------------------------- text
@dataclass(frozen=True)
class TextSpec:
    """What :func:`build_packed_data` packs: the source, its column, how bad rows are handled, the split names."""

    source: Source
    text_field: str = "text"
    bad_rows: str = "refuse"


def _check_text_knobs(seq_len: int, val_fraction, eos_id, vocab_size, doc_mask: bool) -> float:
    """``val_fraction`` as a float, once the text build's knobs are checked (DataError naming the fix)."""
    if seq_len < 2:
        raise DataError(f"data.seq_len={seq_len} is too small; it must be at least 2")
    val_fraction = float(val_fraction)
    if not (0.0 <= val_fraction < 1.0):
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1), e.g. 0.05")
    if eos_id is not None and vocab_size is not None and not (0 <= int(eos_id) < vocab_size):
        raise DataError(
            f"eos_id {eos_id} is outside the model's vocabulary of {vocab_size} entries: "
            "the tokenizer does not match the model"
        )
    if doc_mask and eos_id is None:
        raise DataError("data.doc_mask=true needs an EOS token between documents, but the model config has no "
                        "eos_token_id: set data.doc_mask=false")
    return val_fraction


def build_packed_data(
    text_spec: str | TextSpec,
    tokenizer,
    seq_len: int,
    val_fraction: float = 0.05,
    eos_id: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    log: Callable[[str], None] = lambda m: None,
    progress_s: float = PROGRESS_S,
    doc_mask: bool = False,
) -> PackedData:
    """Tokenize and pack ``text_spec`` (a ``data.source`` string or a :class:`TextSpec`) into a memory-mapped
    :class:`PackedData`, through ``cache_dir`` when given (else a temporary file, unlinked once mapped); with
    ``vocab_size`` every id is checked ``< vocab_size``. ``log`` gets progress lines. ``doc_mask``: positions
    restart after every ``eos_id`` (recorded as ``doc_eos`` in the file; needs ``eos_id``)."""
    seq_len = int(seq_len)
    val_fraction = _check_text_knobs(seq_len, val_fraction, eos_id, vocab_size, doc_mask)
    spec = text_spec if isinstance(text_spec, TextSpec) else TextSpec(resolve_source(str(text_spec), "text"))
    src = spec.source
    vf = None if src.val_split is not None else val_fraction  # a split: the fraction is unused
    fingerprint = text_fingerprint(source_key(src), tokenizer, seq_len, vf, eos_id, spec.text_field,
                                   doc_mask=bool(doc_mask))
    where = space_hint(cache_dir)
    tok_vocab = getattr(tokenizer, "get_vocab_size", None)
    limit = max(vocab_size or 0, tok_vocab(True) if tok_vocab else 1 << 32)
    job = TextJob(src, spec.text_field, seq_len, val_fraction, token_dtype(limit), vocab_size, fingerprint,
                  doc_eos=int(eos_id) if doc_mask else None)

    bad = BadRows()
    whole = lambda: not chunk_safe(tokenizer)  # noqa: E731 - asked only if a document must be cut

    def split(name: str) -> SplitStream:  # rows -> render
        pieces = text_pieces(src, spec.text_field, bad, spec.bad_rows, whole, name)
        return SplitStream(name, token_batches(tokenizer, pieces, eos_id), bad)

    with cache_slot(cache_dir, fingerprint, lambda path: cached_text(path, fingerprint, seq_len, vocab_size), log,
                    where) as slot:
        if slot.data is None:  # not cached: -> pack into the slot's file
            free_check(slot.tmp.parent, src, 2, where)
            write_text(job, [split(n) for n in (src.split, src.val_split) if n], slot.tmp, slot.lock, log, progress_s)
    data, hit = slot.data, slot.hit
    losses = read_losses(data.path) if hit else {}
    if losses.get("bad"):  # what the first build reported, for a relaunch
        log(f"data: {data.n_train + data.n_val} packed sequences of {src.spec} (cached); when built: "
            + BadRows(int(losses["bad"]), str(losses.get("first_bad", ""))).report())
    return data


# ----------------------------------------------------------------------------- chat / prompt_completion
def build_sft_data(spec: str, fmt: str, renderer: ChatRenderer, seq_len: int, val_fraction: float = 0.05,
                   truncation: str = "drop", pad_id: int = 0, cache_dir: str | os.PathLike | None = None,
                   vocab_size: Optional[int] = None, log: Callable[[str], None] = print,
                   fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
                   pack: bool = False, val_split: Optional[str] = None,
                   progress_s: float = PROGRESS_S) -> PackedData:
    """Read, render, label and pad (``pack``: pack, see :mod:`~npu_train.data.pack`) the rows of ``spec`` into a
    memory-mapped :class:`PackedData` with labels (``[N, seq_len + 1]``: ids uint16 / uint32, labels a uint8
    target mask; ``pack``: uint16 / uint32 positions), cached under ``cache_dir`` (else a temporary file,
    unlinked once mapped). ``fields`` maps messages / prompt / completion to the source's columns,
    ``bad_rows`` refuse | skip, ``split`` the save_to_disk split; ``val_split`` a split of the same
    DatasetDict read as the validation samples (``val_fraction`` then unused); ``log`` gets the summary (and a
    progress line every ``progress_s`` seconds of a long build). Raises :class:`DataError` for bad rows
    (naming file and row; a bad row found by reading before a row that fails to render, before an id outside
    ``vocab_size``), an unknown ``truncation``, or fewer than 2 usable rows (with ``val_split``: no usable row
    in one of the splits)."""
    if truncation not in TRUNCATION:
        raise DataError(f"data.truncation={truncation!r}: use one of {list(TRUNCATION)}")
    seq_len = int(seq_len)
    val_split = str(val_split) if val_split else None
    fp = sft_fingerprint(source_key(resolve_source(spec, fmt, split, val_split)), fmt, renderer, seq_len,
                         None if val_split else val_fraction, truncation, pad_id, fields, pack=bool(pack))
    job = SftJob(spec=spec, renderer=renderer, seq_len=seq_len, val_fraction=float(val_fraction or 0.0),
                 pad_id=int(pad_id), vocab_size=vocab_size, fields=fields, bad_rows=bad_rows, split=split,
                 val_split=val_split, fingerprint=fp, where=space_hint(cache_dir), fmt=fmt, truncation=truncation,
                 pack=bool(pack))

    def samples(name: str) -> SplitStream:  # rows -> render
        bad = BadRows()
        rows = iter_rows(spec, fmt, fields, bad_rows, name, log, bad)
        return SplitStream(name, rendered(rows, lambda r: renderer.sample(r[0], r[1], fmt)), bad)

    with cache_slot(cache_dir, fp, lambda path: cached_sft(path, fp, bool(pack)), log, job.where) as slot:
        if slot.data is None:  # not cached: -> pack into the slot's file
            write_sft(job, [samples(n) for n in (split, val_split) if n], slot.tmp, slot.lock, log, progress_s)
    data = slot.data
    if slot.hit:
        log(f"data: {data.n_train + data.n_val} {'packed rows of ' if pack else ''}{fmt} samples from {spec} (cached)"
            + when_built(read_losses(data.path), ("long", "empty"), lambda c: sft_kept_note(job, c)))
    return data


# ----------------------------------------------------------------------------- preference
def build_preference_data(spec: str, renderer: ChatRenderer, seq_len: int, val_fraction: float = 0.05,
                          pad_id: int = 0, cache_dir: str | os.PathLike | None = None,
                          vocab_size: Optional[int] = None, log: Callable[[str], None] = print,
                          fields: Optional[dict] = None, bad_rows: str = "refuse",
                          split: str = "train", val_split: Optional[str] = None,
                          progress_s: float = PROGRESS_S) -> PackedData:
    """Read, tokenize, truncate and pad the preference rows of ``spec`` into a memory-mapped :class:`PackedData`
    with ``pairs=True`` (the layout: :mod:`~npu_train.data.pack`): ``train`` / ``val`` ``[2 * pairs, seq_len +
    1]`` uint16 / uint32 ids, ``train_labels`` / ``val_labels`` the same shape, a uint8 mask (1 on the
    completion tokens: labels = ids there, else ``IGNORE_INDEX``), positions None. Cached under ``cache_dir``
    keyed by :func:`~npu_train.data.cache.preference_fingerprint` (else a temporary file, unlinked once
    mapped). ``fields`` maps prompt / chosen / rejected to the source's columns, ``bad_rows`` refuse | skip,
    ``split`` the save_to_disk split, ``val_split`` a split of the same DatasetDict read as the validation
    pairs (``val_fraction`` then unused); ``log`` gets one summary line (and a progress line every
    ``progress_s`` seconds of a long build). Raises :class:`DataError` for bad rows (naming file and row),
    ids outside ``vocab_size``, or fewer than 2 usable pairs (with ``val_split``: no usable pair in one of the
    splits); FileNotFoundError. Errors come in the order of a build that read every row, then tokenized
    every pair, then checked the ids."""
    seq_len = int(seq_len)
    val_split = str(val_split) if val_split else None
    fp = preference_fingerprint(source_key(resolve_source(spec, "preference", split, val_split)), renderer,
                                seq_len, None if val_split else val_fraction, int(pad_id), fields)
    job = BuildJob(spec=spec, renderer=renderer, seq_len=seq_len, val_fraction=float(val_fraction or 0.0),
                   pad_id=int(pad_id), vocab_size=vocab_size, fields=fields, bad_rows=bad_rows, split=split,
                   val_split=val_split, fingerprint=fp, where=space_hint(cache_dir))

    def pairs(name: str) -> SplitStream:  # rows -> render
        bad = BadRows()
        rows = iter_pairs(spec, fields, bad_rows, name, log, bad)
        return SplitStream(name, rendered(rows, lambda p: pair_tokens(renderer, p)), bad)

    with cache_slot(cache_dir, fp, lambda path: cached_pairs(path, fp), log, job.where) as slot:
        if slot.data is None:  # not cached: -> pack into the slot's file
            write_pairs(job, [pairs(n) for n in (split, val_split) if n], slot.tmp, slot.lock, log, progress_s)
    data = slot.data
    if slot.hit:
        log(f"data: {(data.n_train + data.n_val) // 2} preference pairs from {spec} (cached)"
            + when_built(read_losses(data.path), ("cut", "drop", "left"), lambda c: pairs_kept_note(job, c)))
    return data
