"""Settings -> typed pieces: of :class:`~npu_train.runtime.spec.WorkerSpec` (train and RNGD runtime fields, the
model's tensor index),
and the pipeline's stage count and the planner's :class:`~npu_train.planner.RunShape` (:func:`pipeline_stages`,
:func:`run_shape`).

Used only by :mod:`npu_train.runtime.job` (``prepare``, ``build_worker_specs``, ``run_job``), the one place
worker specs are built.
"""
from __future__ import annotations

import os
from typing import Optional

from npu_train.env import cache_dir
from npu_train.errors import ConfigError
from npu_train.runtime.spec import TrainSpec


def pipeline_stages(cfg, mcfg, kinds: list) -> tuple[int, int, int]:
    """(stages per pipeline P, ``parallel.dp``, ``parallel.zero``) for the cards of ``kinds`` (global-rank
    order, :mod:`npu_train.runtime.layout`) and the model ``mcfg``. Raises :class:`~npu_train.errors.ConfigError`
    when ``data.seq_len`` exceeds the model's, the cards do not divide into ``dp`` replicas of the same kinds,
    or a pipeline has more stages than the model has layers."""
    from npu_train.config import check_dp_cards

    if cfg.data.seq_len > mcfg.max_position_embeddings:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's maximum sequence length "
                          f"{mcfg.max_position_embeddings} (max_position_embeddings): lower data.seq_len")
    # data parallelism: dp replicas of a P-stage pipeline, global rank = replica * P + stage (runtime/layout.py)
    dp, zero = int(cfg.parallel.dp), int(cfg.parallel.zero)
    P = check_dp_cards(len(kinds), dp)
    for k in range(1, dp):
        if kinds[k * P:(k + 1) * P] != kinds[:P]:
            raise ConfigError(f"parallel.dp={dp}: replica {k} has cards {kinds[k * P:(k + 1) * P]} but replica 0 "
                              f"has {kinds[:P]}: list the same card kinds, stage by stage, for every replica")
    if P > mcfg.num_layers:
        if dp == 1:
            raise ConfigError(f"{P} cards but the model has only {mcfg.num_layers} layers: "
                              f"use at most {mcfg.num_layers} backend entries")
        raise ConfigError(f"{P} stages per pipeline ({len(kinds)} cards / parallel.dp={dp}) but the model has only "
                          f"{mcfg.num_layers} layers: use at most {mcfg.num_layers} backend entries per replica "
                          "or raise parallel.dp")
    return P, dp, zero


def run_shape(cfg, mcfg, dtype: str):
    """The planner's :class:`~npu_train.planner.RunShape` of ``cfg`` for the model ``mcfg`` in compute ``dtype``
    (LoRA: the adapter parameters per layer from the model's projection widths)."""
    from npu_train.planner import RunShape

    tr, lora_pl = cfg.train, 0
    if tr.mode == "lora":
        from npu_train.model.lora import LoraSpec

        q_out, kv_out = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
        lora_pl = LoraSpec(r=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets)).params_per_layer(
            mcfg.hidden_size, mcfg.intermediate_size, q_out, kv_out)
    return RunShape(seq_len=cfg.data.seq_len, micro_batch=tr.micro_batch, micro_batches=tr.accum,
                    schedule=tr.schedule, dtype=dtype, recompute=tr.recompute, lora_params_per_layer=lora_pl,
                    grad_accum=tr.grad_accum, offload="serial" if not tr.offload_overlap else
                    "delayed" if tr.offload_update == "delayed" else "overlap")


def train_spec(cfg, dtype: str) -> TrainSpec:
    """The :class:`~npu_train.runtime.spec.TrainSpec` of ``cfg`` with the resolved compute ``dtype``."""
    tr = cfg.train
    return TrainSpec(steps=tr.steps, micro_batch=tr.micro_batch, accum=tr.accum, lr=tr.lr,
                     min_lr_ratio=tr.min_lr_ratio, warmup_steps=tr.warmup_steps, weight_decay=tr.weight_decay,
                     beta1=tr.beta1, beta2=tr.beta2, eps=tr.eps, clip=tr.clip, schedule=tr.schedule,
                     recompute=tr.recompute, seed=tr.seed, save_every=tr.save_every,
                     save_on_interrupt=tr.save_on_interrupt, stop_after=tr.stop_after, dtype=dtype,
                     eval_every=cfg.data.eval_every, eval_batches=cfg.data.eval_batches, mode=tr.mode,
                     lora_rank=cfg.lora.rank, lora_alpha=float(cfg.lora.alpha), lora_dropout=float(cfg.lora.dropout),
                     lora_targets=tuple(cfg.lora.targets), nonfinite=tr.nonfinite,
                     grad_accum=tr.grad_accum, offload_overlap=bool(tr.offload_overlap),
                     offload_update=tr.offload_update, save_checkpoints=bool(cfg.checkpoint.save))


def furiosa_cache_dir(cfg) -> str:
    """``runtime.furiosa.compiler_cache_dir``, default ``<cache root>/furiosa/compiler``
    (:func:`npu_train.env.cache_dir`: ``$NPT_CACHE``, else ``~/.cache/npu-train``), absolute."""
    d = cfg.runtime.furiosa.compiler_cache_dir
    return os.path.abspath(os.path.expanduser(d)) if d else str(cache_dir("furiosa", "compiler"))


def furiosa_runtime_fields(cfg, plan) -> dict:
    """The RNGD fields of :class:`~npu_train.runtime.spec.RuntimeSpec`: compile options (the cache
    directory, the plan's loaded-module count, CPU fallback), accounting, warm-up."""
    from npu_train.backends.furiosa_compile import FuriosaCompileOptions

    fur = cfg.runtime.furiosa
    n = max((t.loaded_modules for t, st in zip(plan.memory_terms, plan.stages)
             if st.card.kind == "furiosa"), default=int(fur.loaded_modules))
    return {"furiosa": FuriosaCompileOptions(compiler_cache_dir=furiosa_cache_dir(cfg), loaded_modules=int(n),
                                             cpu_fallback=bool(fur.cpu_fallback), probe_free=bool(fur.probe_free),
                                             compiled_layers=bool(fur.compiled_layers)),
            "furiosa_accounting": str(fur.accounting), "warmup": bool(fur.warmup)}


def model_index(model_path: Optional[str]) -> Optional[dict]:
    """:attr:`~npu_train.runtime.spec.WorkerSpec.model_index`: for a GGUF file, its tensor table
    (:func:`npu_train.model.gguf.gguf_tensor_index`, from the reader this process cached when it read the
    config and checked the weights), so each card process reads its tensors at those offsets instead of
    parsing the file's metadata again (seconds of CPU per process for a 49k-token vocabulary); None for an
    HF safetensors directory (its headers are cheap to read) or no file (a shape preset)."""
    from npu_train.model.files import is_gguf_path

    if model_path is None or not is_gguf_path(os.path.expanduser(model_path)):
        return None
    from npu_train.model.gguf import gguf_tensor_index

    return gguf_tensor_index(os.path.expanduser(model_path))
