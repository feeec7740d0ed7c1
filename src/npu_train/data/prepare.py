"""Job-side data preparation (``data.*`` keys): :func:`prepare_data` returns the run's
:class:`~npu_train.data.dataset.PackedData` (text: packed rows, ``data.doc_mask``: with document positions;
chat / prompt_completion: samples packed into rows with positions, ``data.pack=false``: one padded sample per row;
preference: chosen / rejected pairs in consecutive padded rows, :mod:`npu_train.data.preference`)."""
from __future__ import annotations

from typing import Callable

from npu_train.env import cache_dir

from .chat import FIELDS, FORMATS
from .sources import BAD_ROWS, resolve_source
from .text import DataError

__all__ = ["prepare_data"]


def prepare_data(cfg, model_path: str, model_cfg, log: Callable[[str], None] = print):
    """Tokenize (and pack or pad) ``cfg.data.source`` once, cached under ``cache_dir("data")`` as a
    memory-mapped file built by one process at a time (another node / launch on the same cache waits), every
    format streamed (the launcher's memory does not grow with the corpus).

    ``model_cfg`` gives ``eos_token_id`` and ``vocab_size``; ``log`` gets chat sample counts. Raises
    :class:`DataError` for bad data or an unknown ``data.format`` / ``data.truncation``, FileNotFoundError."""
    from npu_train.model import chat_template, load_tokenizer, resolve_model_path, special_tokens

    d = cfg.data
    fmt = str(getattr(d, "format", "text") or "text")
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r}: use one of {list(FORMATS)}")
    tok_path = resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tok = load_tokenizer(tok_path)
    cache = str(cache_dir("data"))
    bad_rows = str(getattr(d, "bad_rows", "refuse") or "refuse")
    if bad_rows not in BAD_ROWS:
        raise DataError(f"data.bad_rows={bad_rows!r}: use one of {list(BAD_ROWS)}")
    split, val_split = str(getattr(d, "split", None) or "train"), getattr(d, "val_split", None) or None
    if fmt == "text":
        from .dataset import TextSpec, build_packed_data

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
    from .chat import ChatRenderer
    from .sft import build_sft_data

    src = tok_path
    template = chat_template(tok_path)
    if template is None and tok_path != model_path:
        src, template = model_path, chat_template(model_path)
    specials = special_tokens(src)
    eos = model_cfg.eos_token_id
    renderer = ChatRenderer(tok, template, eos_id=eos, **specials)
    if fmt == "preference":
        from .preference import build_preference_data

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
