"""Export a checkpoint to a merged Hugging Face directory that ``transformers`` loads (:func:`export_hf`).

``python -m npu_train.checkpoint.export <checkpoint dir> <out dir> [--dtype bf16|fp32]`` writes
``model.safetensors`` (fp32 masters cast to ``--dtype``; LoRA merged as ``W + (alpha/r) B A``, the
adapters also in PEFT's layout under ``adapter/``), ``config.json`` and the run's tokenizer files.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch
from safetensors.torch import save_file

from npu_train.checkpoint.store import CheckpointReader
from npu_train.checkpoint.stream import Entry, check_memory, write_stream
from npu_train.model.config import FAMILIES, LlamaConfig
from npu_train.model.llama import stage_param_names


def hf_config_dict(cfg: LlamaConfig, dtype: str) -> dict:
    """``config.json`` contents for ``cfg`` in the format of transformers' config class of ``cfg.family``
    (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``)."""
    fam = FAMILIES[cfg.family]
    d = {
        "architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if cfg.family in ("llama", "qwen3"):
        d["attention_bias"] = False
    if cfg.family == "llama":
        d["mlp_bias"] = False
    if cfg.family in ("qwen2", "qwen3"):
        d.update(use_sliding_window=False, sliding_window=None)
    if cfg.family == "mistral":
        d["sliding_window"] = cfg.sliding_window
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        d["eos_token_id"] = cfg.eos_token_id
    return d


def _lora_getter(reader, cfg, names, train: dict, out_dir: str, tdt):
    """Write ``<out_dir>/adapter`` (PEFT layout); return ``name -> W + (alpha / r) * B @ A``."""
    from npu_train.model import load_tensors
    from npu_train.model.lora import LoraSpec, merge_adapters, peft_config, peft_state_dict

    spec = LoraSpec(r=int(train["lora_rank"]), alpha=float(train["lora_alpha"]),
                    dropout=float(train["lora_dropout"]), targets=tuple(train["lora_targets"]))
    adapters = {k[len("master."):]: reader.get(k) for k in reader.manifest["index"]
                if k.startswith("master.") and ".lora_" in k}
    model_path = reader.manifest["model_path"]
    adir = os.path.join(out_dir, "adapter")
    os.makedirs(adir, exist_ok=True)
    save_file({k: v.to(tdt).contiguous() for k, v in peft_state_dict(adapters).items()},
              os.path.join(adir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(adir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(spec, model_path), f, indent=1)
    return lambda n: merge_adapters(load_tensors(model_path, cfg, [n]), adapters, spec, [n])[n].to(tdt).contiguous()


def export_bound(cfg: LlamaConfig, lora: bool) -> int:
    """Extra host memory of :func:`export_hf`, bytes: about 3 fp32 copies of the largest weight."""
    big = max(cfg.vocab_size * cfg.hidden_size, cfg.hidden_size * cfg.intermediate_size)
    return 4 * big * (4 if lora else 3)


def export_hf(ckpt_dir: str, out_dir: str, dtype: str = "bf16", arg: Optional[str] = None) -> str:
    """Merge the shards of ``ckpt_dir`` into the HF directory ``out_dir`` tensor by tensor; returns ``out_dir``.
    ``arg``: how errors name ``ckpt_dir``. Raises CheckpointError (incomplete checkpoint or missing tensor),
    MemoryCheckError (less host memory than :func:`export_bound`), ValueError (unknown ``dtype``)."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: use bf16 or fp32")
    from npu_train.checkpoint.store import find_checkpoint

    # a step_XXXXXX dir or a checkpoint root (never the trainer's keywords latest/auto)
    arg = arg or f"python -m npu_train.checkpoint.export <checkpoint>={ckpt_dir!r}"
    reader = CheckpointReader(find_checkpoint(os.path.abspath(ckpt_dir), None, arg=arg))
    cfg = LlamaConfig.from_dict(reader.manifest["model"])
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    names = stage_param_names(cfg, 0, cfg.num_layers, True, True)
    train = reader.manifest.get("train") or {}
    lora = train.get("mode") == "lora"
    check_memory(export_bound(cfg, lora), f"export of {reader.path}", "free host memory (other processes) and retry")
    os.makedirs(out_dir, exist_ok=True)
    if lora:
        get = _lora_getter(reader, cfg, names, train, out_dir, tdt)
    else:
        get = lambda n: reader.get(f"master.{n}").to(tdt).contiguous()  # noqa: E731
    shapes = dict(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        shapes.update(cfg.param_shapes(i))
    write_stream(os.path.join(out_dir, "model.safetensors"),
                 [Entry(n, tdt, tuple(shapes[n]), lambda n=n: get(n)) for n in names], {"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype), f, indent=1)
    src = reader.manifest.get("tokenizer_path")
    if src:
        from npu_train.model import load_tokenizer

        from npu_train.model import chat_template, special_tokens

        load_tokenizer(src).save(os.path.join(out_dir, "tokenizer.json"))
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **{k: v for k, v in special_tokens(src).items() if v}}
        template = chat_template(src)
        if template:
            tc["chat_template"] = template
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f, indent=1)
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a step_XXXXXX checkpoint directory, or a checkpoint root (newest is used)")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="tensor dtype written (default bf16; fp32 keeps the master weights exactly)")
    a = ap.parse_args(argv)
    try:
        out = export_hf(a.checkpoint, a.out, a.dtype)
    except Exception as e:  # user-facing CLI: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {a.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
