"""Settings -> the typed pieces of :class:`~npu_train.runtime.spec.WorkerSpec` (train and RNGD runtime fields).

Used only by :func:`npu_train.runtime.job.build_worker_specs` and :func:`npu_train.runtime.job.run_job`,
the one place worker specs are built.
"""
from __future__ import annotations

import os

from npu_train.env import cache_dir
from npu_train.runtime.spec import TrainSpec


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
                     offload_update=tr.offload_update)


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
