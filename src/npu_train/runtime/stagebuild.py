"""Building one card process's stage: its module on the card, fp32 masters from the model file or the
checkpoint, and the per-kind choices made at start-up.
"""
from __future__ import annotations

import torch

from npu_train.hardware import FUSED_HEAD_KINDS, SPARSE_EMBED_GRAD_KINDS
from npu_train.runtime.spec import WorkerSpec


def compute_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``, ``"fp32"`` -> ``torch.float32``."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def build_stage(spec: WorkerSpec, backend, dtype: torch.dtype):
    """Build this stage's module on the card and its fp32 masters (own tensors only, from the model file or a
    full fine-tuning resume's checkpoint), reading one tensor at a time. Returns ``(module, masters)``: the
    StageModule in ``dtype`` on ``backend.device()`` and ``{hf_name: fp32 CPU tensor}`` (read on lookup when
    resuming; empty for ``train.mode=lora``, whose frozen base has no masters)."""
    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import StageModule
    from npu_train.model.moe import stack_experts

    cfg = LlamaConfig.from_dict(spec.model_cfg)
    st = spec.stage
    rows = vocab_rows_of(spec)
    with torch.device("meta"):
        module = StageModule(cfg, st.first, st.last, st.has_embed, st.has_head, recompute=spec.train.recompute,
                             second=st.second, recompute_attention=spec.train.recompute_attention,
                             recompute_layers=st.recompute_layers, vocab=rows)
    module = module.to(dtype)
    with backend.alloc_lock():
        module = module.to_empty(device=backend.device())
        stack_experts(module, copy=False)  # to_empty gave each expert weight its own storage: stack them again
    if st.has_embed and st.has_head and cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight  # to_empty breaks parameter sharing
    track = getattr(backend, "track", None)  # furiosa: no allocator stats, count our own tensors
    if track is not None:
        for p in module.parameters():
            track(p)
    module.fused_head = spec.card.kind in FUSED_HEAD_KINDS  # the head's fused weight gradient and loss
    params = dict(module.named_parameters())  # a tied head is the embedding's parameter, listed once
    if spec.resume_dir and spec.train.mode == "full":  # every weight is in the checkpoint: skip the model file
        masters = CheckpointMasters(spec.resume_dir, rows)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(backend.upload(masters[n].to(dtype)))
        return module, masters
    masters = load_stage_weights(spec, cfg, params, backend, dtype, masters=spec.train.mode == "full")
    return module, masters


def vocab_rows_of(spec: WorkerSpec):
    """``(start, end)`` rows of the output layer this card holds under vocabulary parallelism
    (:func:`~npu_train.pipeline.vocab.vocab_rows`), else None."""
    if not spec.train.vocab:
        return None
    from npu_train.pipeline.vocab import vocab_rows

    return vocab_rows(int(spec.model_cfg["vocab_size"]), spec.num_stages, spec.stage_index)


def _window(c, p, rows):
    """``(rows of p, part)`` of chunk ``c`` in parameter ``p``: the chunk's own rows, or (``rows`` = the card's
    ``(start, end)`` of ``lm_head.weight``) their overlap with the card's rows (None: none)."""
    if rows is None or c.name != "lm_head.weight":
        return c.rows, c.part
    a, b = rows
    lo, hi = max(c.rows.start, a), min(c.rows.stop, b)
    if lo >= hi:
        return None
    return slice(lo - a, hi - a), c.part[lo - c.rows.start:hi - c.rows.start]


def load_stage_weights(spec: WorkerSpec, cfg, params: dict, backend, dtype: torch.dtype, masters: bool) -> dict:
    """Fill ``params`` (the stage's parameters on the card, in ``dtype``) from the model file a chunk of rows at a
    time (:func:`npu_train.model.chunks.iter_chunks`): no full-size conversion buffer ever exists. ``masters``
    (full fine-tuning): also the fp32 masters, returned ``{hf_name: fp32 CPU tensor}`` (an fp32 parameter in
    host memory is its own master, one buffer; LoRA: ``{}``). Samples the card's memory after every chunk, so
    the load's peak is in :meth:`~npu_train.backends.base.Backend.max_memory_allocated`. Raises
    :class:`~npu_train.model.files.ModelFormatError` as the loaders do."""
    from npu_train.model.chunks import iter_chunks

    out: dict = {}
    own = set()  # fp32 parameters in host memory: their own masters
    vrows = vocab_rows_of(spec)  # vocabulary-parallel: only this card's rows of lm_head.weight
    with torch.no_grad():
        for c in iter_chunks(spec.model_path, cfg, list(params), index=spec.model_index):
            p = params[c.name]
            win = _window(c, p, vrows)
            if win is None:
                continue
            rows, part = win
            if masters and c.name not in out:  # the parameter itself, else a fresh fp32 buffer
                if p.dtype == torch.float32 and p.device.type == "cpu":
                    own.add(c.name)
                out[c.name] = p.detach() if c.name in own else torch.empty(tuple(p.shape), dtype=torch.float32)
            if masters and c.name not in own:
                out[c.name][rows].copy_(part)
            if p.device.type == "cpu":  # the cast happens inside copy_: no fp32 temporary, no upload clone
                p[rows].copy_(part)
            else:
                p[rows].copy_(backend.upload(part.to(dtype)))
            backend.memory_allocated()  # a sample with the chunk's buffers alive (cpu: the load's peak)
            del c
    return out


class CheckpointMasters:
    """HF name -> fp32 master read from a checkpoint on each lookup (nothing held: one tensor at a time);
    ``rows``: this card's ``(start, end)`` of ``lm_head.weight`` under vocabulary parallelism (None: whole)."""

    def __init__(self, path: str, rows=None):
        from npu_train.checkpoint.store import CheckpointReader

        self.reader = CheckpointReader(path)
        self.get = vocab_getter(self.reader.get, rows)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get(f"master.{name}")


def vocab_getter(get, rows):
    """``get`` (checkpoint key -> tensor), with the ``*.lm_head.weight`` entries cut to ``rows`` (the card's
    ``(start, end)`` under vocabulary parallelism; None: ``get`` itself)."""
    if rows is None:
        return get
    a, b = rows
    return lambda key: get(key)[a:b].clone() if key.endswith(".lm_head.weight") else get(key)


def resume_stage(reader, opt, params: dict, owned: dict, backend, stage: int, rows=None,
                 vocab_size: int = 0) -> None:
    """Load masters, moments, step and RNG from ``reader`` one tensor at a time (extra memory: ~2x the largest
    tensor, checked first: MemoryCheckError); ``rows``: as :func:`vocab_getter` (the whole ``vocab_size`` rows
    of the output layer are read, then cut)."""
    from npu_train.checkpoint.stream import check_memory

    big = max((4 * p.numel() for p in params.values()), default=0)
    if rows is not None and "lm_head.weight" in params:
        big = max(big, 4 * params["lm_head.weight"].shape[1] * int(vocab_size))
    check_memory(2 * big, f"resume from {reader.path}", "free host memory (other processes) and retry")
    get = vocab_getter(reader.get, rows)
    opt.load_state_tensors(get, reader.step)
    with torch.no_grad():  # ZeRO-1: the weights this replica does not own come from the masters too
        for n in set(params) - set(owned):
            params[n].copy_(backend.upload(get(f"master.{n}").to(params[n].dtype)))
    if reader.has(f"rng.{stage}"):
        torch.set_rng_state(reader.get(f"rng.{stage}"))


def sparse_embed_grad_for(kind: str, params: dict) -> bool:
    """Whether the stage takes its embedding gradient as rows: a trained fp32 embedding on a
    :data:`npu_train.hardware.SPARSE_EMBED_GRAD_KINDS` card (zeroed after each step's first forward)."""
    emb = params.get("model.embed_tokens.weight")
    return emb is not None and kind in SPARSE_EMBED_GRAD_KINDS and emb.dtype == torch.float32
