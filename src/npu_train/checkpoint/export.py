"""Export a checkpoint to a merged Hugging Face directory that ``transformers`` loads (:func:`export_hf`).

``python -m npu_train.checkpoint.export <checkpoint dir> <out dir> [--dtype auto|bf16|fp32] [--overwrite] [--base DIR]``
writes
``model.safetensors`` (fp32 masters cast to ``--dtype``; LoRA merged as ``W + (alpha/r) B A``, the
adapters also in PEFT's layout under ``adapter/``; ``auto``, the default: bf16, and fp32 for a LoRA merge, much of
whose update a bf16 cast can round away: :func:`export_dtype`), ``config.json``, the run's tokenizer files and
:data:`RECORD` (the files written). A non-empty ``<out dir>`` is refused unless ``--overwrite``, which first
removes only the files an export writes (:func:`clear_earlier_export`), never another file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from npu_train.checkpoint.store import CheckpointReader
from npu_train.errors import UserError, fmt_disk_bytes, nearest_existing, out_of_space
from npu_train.checkpoint.stream import Entry, check_memory, write_stream
from npu_train.model.config import FAMILIES, LlamaConfig
from npu_train.model.llama import stage_param_names


def hf_config_dict(cfg: LlamaConfig, dtype: str) -> dict:
    """``config.json`` contents for ``cfg`` in the format of transformers' config class of ``cfg.family``
    (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``, ``Qwen3MoeConfig``, ``Qwen2MoeConfig``,
    ``MixtralConfig``)."""
    fam = FAMILIES[cfg.family]
    d = {
        "architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        # transformers >= 4.56 reads "dtype", older releases "torch_dtype": both, same value
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
        "dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if cfg.family in ("llama", "qwen3", "qwen3_moe"):
        d["attention_bias"] = False
    if cfg.family == "llama":
        d["mlp_bias"] = False
    if cfg.family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        d.update(use_sliding_window=False, sliding_window=None)
    if cfg.family in ("mistral", "mixtral"):
        d["sliding_window"] = cfg.sliding_window
    if cfg.is_moe:
        d.update(moe_config_dict(cfg))
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        d["eos_token_id"] = cfg.eos_token_id
    return d


def moe_config_dict(cfg: LlamaConfig) -> dict:
    """The mixture-of-experts keys of ``config.json`` under transformers' names (``Qwen3MoeConfig``,
    ``Qwen2MoeConfig``: ``num_experts``, ``moe_intermediate_size``; ``MixtralConfig``: ``num_local_experts``,
    experts of width ``intermediate_size``)."""
    d = {"num_experts_per_tok": cfg.num_experts_per_tok, "router_aux_loss_coef": cfg.router_aux_loss_coef,
         "output_router_logits": cfg.output_router_logits}
    if cfg.family == "mixtral":
        d.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_intermediate_size,
                 router_jitter_noise=0.0)
        return d
    d.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
             norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
             mlp_only_layers=list(cfg.mlp_only_layers))
    if cfg.family == "qwen2_moe":
        d.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=True)
    return d


@dataclass
class MergeRounding:
    """What casting LoRA-merged weights to the export dtype does to the update ``U = W' - W`` (fp32 merge
    ``W' = W + (alpha / r) B A``, or a trained router's own weight): sums of squares over every merged tensor of
    ``U`` and of the rounding error ``cast(W') - W'``. A short LoRA run's ``U`` is often below half a bf16 step of
    ``W`` (2**-9 relative): the bf16 merge then rounds it away (a Qwen3-MoE at hidden 2048 after 6 steps at lr 1e-4
    kept 22 % of it, experiments/2026-12-06-moe.md), while the adapter keeps it."""

    update_sq: float = 0.0
    error_sq: float = 0.0

    def add(self, base: torch.Tensor, merged: torch.Tensor, written: torch.Tensor) -> None:
        """One tensor: the base weight, the fp32 merge, what is written (any dtype). In fp32: both differences are
        of numbers within a factor 2 of each other where the update is small against ``W`` (Sterbenz: exact) and
        the sums of squares are fp32 cascade sums (about 1e-7 relative); the fp64 copies of every tensor made
        this 7x slower and most of a LoRA export's time (experiments/2026-12-06-moe.md)."""
        upd = merged.float() - base.float()
        err = written.float() - merged.float()
        self.update_sq += float(upd.square_().sum())
        self.error_sq += float(err.square_().sum())

    @property
    def ratio(self) -> float:
        """``||cast(W') - W'|| / ||W' - W||`` over the merged tensors (0 without an update)."""
        return math.sqrt(self.error_sq / self.update_sq) if self.update_sq > 0 else 0.0

    def line(self, dtype: str, auto: bool = False) -> str:
        """The export's line on it: ``dtype`` the merged weights' (bf16: what its rounding did, with the fix when it
        changes more than 1 % of the update; fp32: what bf16 would have done, ``auto``: fp32 chosen for that)."""
        share = f"{100 * self.ratio:.1f} % (norm of the rounding error / norm of the update)"
        if dtype == "fp32":
            text = f"export: LoRA merged in fp32, the update W' - W kept; bf16 would change it by {share}"
            if auto:
                text += ("; fp32 is the default of a LoRA merge for that reason (peft's merge_and_unload on a "
                         "bf16 base rounds the same way); --dtype bf16 writes half the bytes")
            return text
        text = f"export: rounding the merged weights to {dtype} changes the LoRA update W' - W by {share}"
        if self.ratio > 0.01:
            text += ("; the adapter (adapter/, on the base with peft) keeps the update, and so does --dtype fp32 "
                     "(the default) for the merged weights")
        return text


def export_dtype(dtype: str, lora: bool) -> str:
    """The dtype an export writes for ``--dtype`` ``dtype``: ``auto`` is fp32 for a LoRA merge and bf16 for full
    fine-tuning; ``bf16`` / ``fp32`` as given.

    Why fp32 for LoRA: the merge ``W' = W + (alpha / r) B A`` adds an update that, after a fine-tuning run of
    ordinary length, is mostly below half a bf16 step of ``W`` (2**-9 relative), so a bf16 ``W'`` is ``W`` again
    in most entries (a bf16 base, update ~2e-5 against |W| ~ 0.02: the merged logits missed 75 % of the
    fine-tuning effect, tests/unit/test_export_cli.py). After the 20 LoRA steps on the shipped chat rows the
    default job suggests next, the bf16 rounding error was 3.2 x the update, mostly the rounding of its GGUF base,
    which is not bf16; the bf16 export's held-out loss was 4.2787 against the trained model's 4.2635 (the base
    4.6431), the fp32 export's 4.2635 (experiments/2026-12-06-first-impressions.md). peft does the
    same on a bf16 base (``LoraLayer.merge``: ``base_layer.weight.data += delta_weight`` in the base's dtype;
    huggingface/peft#1388), which is why its merged models are usually saved from an fp32 base. Full fine-tuning
    keeps bf16: its masters are the model (no separate update to lose), as a bf16 run computes with them."""
    if dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: use auto, bf16 or fp32")
    if dtype == "auto":
        return "fp32" if lora else "bf16"
    return dtype


def _lora_getter(reader, cfg, names, train: dict, out_dir: str, tdt, model_path: str, rounding: MergeRounding):
    """Write ``<out_dir>/adapter`` (PEFT layout); return ``name -> W + (alpha / r) * B @ A`` on the base
    ``model_path`` (checked by :func:`base_model`) in ``tdt``, adding each merged tensor to ``rounding``."""
    from npu_train.model import load_tensors
    from npu_train.model.lora import LoraSpec, is_router, merge_adapters, peft_config, peft_state_dict

    spec = LoraSpec(r=int(train["lora_rank"]), alpha=float(train["lora_alpha"]),
                    dropout=float(train["lora_dropout"]), targets=tuple(train["lora_targets"]),
                    train_router=bool(train.get("lora_train_router", False)))
    adapters = {k[len("master."):]: reader.get(k) for k in reader.manifest["index"]
                if k.startswith("master.") and (".lora_" in k or (spec.train_router and is_router(k)))}
    adir = os.path.join(out_dir, "adapter")
    os.makedirs(adir, exist_ok=True)
    save_file({k: v.to(tdt).contiguous() for k, v in peft_state_dict(adapters, spec, cfg.family).items()},
              os.path.join(adir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(adir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(spec, model_path, cfg.family), f, indent=1)

    def get(n: str) -> torch.Tensor:
        base = load_tensors(model_path, cfg, [n])
        merged = merge_adapters(base, adapters, spec, [n])[n]
        out = merged.to(tdt).contiguous()
        if n in adapters or f"{n[: -len('.weight')]}.lora_A.weight" in adapters:
            # bf16: what the cast did; fp32: what a bf16 cast would have done (the line says which)
            rounding.add(base[n], merged, merged.to(torch.bfloat16))
        return out

    return get


#: the record of an export's files (relative paths), written last
RECORD = "npt_export.json"
#: every file an export may write (relative paths): what ``--overwrite`` removes besides :data:`RECORD`'s list
EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "adapter/adapter_model.safetensors", "adapter/adapter_config.json", RECORD)


class ExportDirError(UserError):
    """The output directory holds files and ``--overwrite`` was not given (exit 2)."""


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse a non-empty ``out_dir`` without ``overwrite`` (:class:`ExportDirError`, naming a few files)."""
    try:
        names = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        culprit = nearest_existing(out_dir)
        if culprit == os.path.abspath(out_dir):
            raise ExportDirError(f"{out_dir} is a file, not a directory: give a new or empty output "
                                 "directory") from None
        raise ExportDirError(f"{culprit} is a file, not a directory, so {out_dir} cannot be made in it: give an "
                             "output directory under a directory") from None
    if names and not overwrite:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ExportDirError(f"{out_dir} is not empty ({shown}): give a new or empty output directory, or --overwrite "
                             "to replace an earlier export there (removes only the files an export writes: "
                             "model.safetensors, config.json, tokenizer*.json, adapter/; other files stay)")


def _first_missing(path: str) -> Optional[str]:
    """The outermost of ``path`` and its parents that does not exist yet (None when ``path`` exists): the child
    of :func:`~npu_train.errors.nearest_existing` on the way to ``path``."""
    p, at = os.path.abspath(path), nearest_existing(path)
    return None if at == p else os.path.join(at, os.path.relpath(p, at).split(os.sep)[0])


#: room kept beyond the weights for config.json, the tokenizer files and the record (bytes)
EXPORT_MARGIN_BYTES = 32 << 20


def check_export_space(out_dir: str, weight_bytes: int, overwrite: bool) -> None:
    """Refuse (:class:`ExportDirError`) an export that does not fit the free space at ``out_dir`` (its nearest
    existing parent when it is new), before anything is written: ``weight_bytes`` of ``model.safetensors`` plus
    :data:`EXPORT_MARGIN_BYTES`; with ``overwrite`` the earlier ``model.safetensors`` there counts as free."""
    at = nearest_existing(out_dir)
    free = shutil.disk_usage(at).free
    old = os.path.join(out_dir, "model.safetensors")
    if overwrite and os.path.isfile(old):
        free += os.path.getsize(old)
    need = weight_bytes + EXPORT_MARGIN_BYTES
    if free < need:
        raise ExportDirError(f"export needs {fmt_disk_bytes(need)} at {at}, {fmt_disk_bytes(free)} free: free space "
                             "there or give another output directory")


def make_out_dir(out_dir: str) -> None:
    """``os.makedirs(out_dir)``, a refusal naming the fix (:class:`ExportDirError`) when it cannot be made."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            raise ExportDirError(f"{nearest_existing(out_dir)} is a file, not a directory: give an output "
                                 "directory under a directory") from None
        raise ExportDirError(f"cannot write {out_dir} ({e.strerror or e}): choose a directory you can write") from None


def clear_earlier_export(out_dir: str) -> list[str]:
    """Remove an earlier export's files from ``out_dir`` (:data:`EXPORT_FILES` and those :data:`RECORD` lists,
    never a path outside ``out_dir``) and ``adapter/`` once empty; returns the removed relative paths."""
    listed: list = []
    try:
        with open(os.path.join(out_dir, RECORD)) as f:
            listed = [p for p in json.load(f).get("files", []) if isinstance(p, str)]
    except (OSError, ValueError, AttributeError):
        pass
    root, removed = os.path.realpath(out_dir), []
    for rel in sorted(set(EXPORT_FILES) | set(listed)):
        p = os.path.realpath(os.path.join(out_dir, rel))
        if os.path.commonpath([root, p]) != root or not os.path.isfile(p):
            continue
        os.remove(p)
        removed.append(rel)
    try:
        os.rmdir(os.path.join(out_dir, "adapter"))  # only when empty: a user's file there stays
    except OSError:
        pass
    return removed


def _write_record(out_dir: str, ckpt: str) -> None:
    files = sorted(os.path.relpath(os.path.join(d, f), out_dir) for d, _, fs in os.walk(out_dir) for f in fs
                   if os.path.relpath(os.path.join(d, f), out_dir) in EXPORT_FILES)
    with open(os.path.join(out_dir, RECORD), "w") as f:
        json.dump({"checkpoint": ckpt, "files": [x for x in files if x != RECORD] + [RECORD]}, f, indent=1)


class BaseModelError(UserError):
    """A LoRA checkpoint's base model cannot be found, or is not the one its adapters were trained on (exit 2)."""


def base_model(reader, base: Optional[str], lora: bool) -> Optional[str]:
    """The base model an export of ``reader``'s checkpoint reads (LoRA: the frozen weights the adapters merge
    into; also the tokenizer's and ``generation_config.json``'s source): ``base`` (``--base``: the recorded base's
    new place) or the run's recorded ``model_path``. Raises :class:`BaseModelError`, before anything is written,
    for a LoRA base that does not exist, was recorded as a relative path (older runs; ambiguous from another
    directory), or whose weights differ from the recorded ``model_fingerprint``."""
    recorded = reader.manifest.get("model_path")
    path = os.path.abspath(os.path.expanduser(base)) if base else recorded
    if not lora:
        return path
    fix = "pass its new place with --base <HF model dir or .gguf file>"
    if base and not os.path.exists(path):
        raise BaseModelError(f"--base {base} does not exist: give the directory (or .gguf file) the base model of "
                             f"{reader.path} was moved to (recorded model.path={recorded})")
    if not base and (not recorded or not os.path.isabs(recorded)):
        raise BaseModelError(f"{reader.path} is a LoRA checkpoint whose base model was recorded as "
                             f"{recorded!r}, a path relative to the directory its run was launched from: {fix}")
    if not os.path.exists(path):
        raise BaseModelError(f"{reader.path} is a LoRA checkpoint of the base model at {recorded} (its run's "
                             f"model.path), which does not exist any more (moved or deleted): {fix}")
    saved = reader.manifest.get("model_fingerprint")
    if saved:
        from npu_train.model.weights import model_fingerprint

        if model_fingerprint(path) != saved:
            which = f"--base {base}" if base else f"the recorded base model {recorded}"
            raise BaseModelError(f"{which} holds other weights than the base {reader.path}'s LoRA adapters were "
                                 "trained on (replaced or another model; merging them would give wrong outputs "
                                 f"silently): {fix} (the original weights)")
    return path


def tokenizer_source(reader, base: Optional[str], model_path: Optional[str]) -> Optional[str]:
    """Where the export reads the tokenizer: the recorded ``tokenizer_path`` (the base's new place when it was
    the base's and ``--base`` moved it). Raises :class:`BaseModelError` when it does not exist."""
    src, recorded = reader.manifest.get("tokenizer_path"), reader.manifest.get("model_path")
    if src and base and src == recorded:
        src = model_path
    if src and src not in ("embedded", "smollm2") and not os.path.exists(os.path.expanduser(src)):
        raise BaseModelError(f"{reader.path}: the tokenizer its run used, {src}, does not exist any more (moved or "
                             "deleted): pass the base model's new place with --base <HF model dir or .gguf file>")
    return src


def export_bound(cfg: LlamaConfig, lora: bool) -> int:
    """Extra host memory of :func:`export_hf`, bytes: about 3 fp32 copies of the largest weight."""
    big = max(cfg.vocab_size * cfg.hidden_size, cfg.hidden_size * cfg.intermediate_size)
    return 4 * big * (4 if lora else 3)


#: the export's progress lines: one at each of these fractions of the tensors written
PROGRESS_AT = (0.25, 0.5, 0.75)


def _counted(entries: list, say: Callable[[str], None]) -> list:
    """``entries`` whose fetches say, at each :data:`PROGRESS_AT` fraction of them, how many were written."""
    n, marks = len(entries), {max(1, int(round(f * len(entries)))) for f in PROGRESS_AT}
    total = sum(e.nbytes for e in entries)
    done = {"k": 0, "bytes": 0}

    def wrap(e):
        def fetch():
            t = e.get()
            done["k"] += 1
            done["bytes"] += e.nbytes
            if done["k"] in marks and done["k"] < n:
                say(f"export: {done['k']}/{n} tensors ({fmt_disk_bytes(done['bytes'])} of {fmt_disk_bytes(total)})")
            return t
        return Entry(e.name, e.dtype, e.shape, fetch)

    return [wrap(e) for e in entries]


def _write_export(reader, cfg: LlamaConfig, names: list, train: dict, out_dir: str, dtype: str, tdt, model_path,
                  tok_src, say: Callable[[str], None], auto: bool = False) -> None:
    """The files of :func:`export_hf` into ``out_dir`` (weights, config, tokenizer, record); ``say``: progress."""
    lora = train.get("mode") == "lora"
    rounding = MergeRounding()
    if lora:
        get = _lora_getter(reader, cfg, names, train, out_dir, tdt, model_path, rounding)
    else:
        get = lambda n: reader.get(f"master.{n}").to(tdt).contiguous()  # noqa: E731
    shapes = dict(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        shapes.update(cfg.param_shapes(i))
    entries = [Entry(n, tdt, tuple(shapes[n]), lambda n=n: get(n)) for n in names]
    say(f"export: {reader.path} -> {os.path.join(out_dir, 'model.safetensors')}: {len(entries)} tensors, "
        f"{fmt_disk_bytes(sum(e.nbytes for e in entries))} {dtype}" + (", LoRA merged into the base" if lora else ""))
    write_stream(os.path.join(out_dir, "model.safetensors"), _counted(entries, say), {"format": "pt"})
    if lora:
        say(rounding.line(dtype, auto))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype), f, indent=1)
    src = tok_src
    if src:
        from npu_train.model import chat_template, load_tokenizer, special_tokens
        from npu_train.model.files import is_gguf_path

        say(f"export: tokenizer from {src}" + (" (built from the GGUF's embedded vocabulary and merges)"
                                              if is_gguf_path(src) else ""))

        load_tokenizer(src).save(os.path.join(out_dir, "tokenizer.json"))
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **{k: v for k, v in special_tokens(src).items() if v}}
        template = chat_template(src)
        if template:
            tc["chat_template"] = template
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f, indent=1)
    _copy_generation_config(model_path, out_dir)
    _write_record(out_dir, reader.path)


def export_hf(ckpt_dir: str, out_dir: str, dtype: str = "auto", arg: Optional[str] = None,
              overwrite: bool = False, base: Optional[str] = None,
              say: Callable[[str], None] = lambda _text: None) -> str:
    """Merge the shards of ``ckpt_dir`` into the HF directory ``out_dir`` tensor by tensor; returns ``out_dir``.
    ``arg``: how errors name ``ckpt_dir``; ``overwrite``: replace an earlier export in ``out_dir``
    (:func:`clear_earlier_export`); ``say``: progress lines (the CLI prints them: an 8B export takes minutes). Raises CheckpointError (incomplete checkpoint or missing tensor),
    ExportDirError (non-empty ``out_dir`` without ``overwrite``), BaseModelError (a LoRA checkpoint's base cannot
    be found or has other weights: ``base`` names its new place; :func:`base_model`), MemoryCheckError (less host memory than
    :func:`export_bound`), ValueError (unknown ``dtype``). ``dtype``: ``auto`` (fp32 for a LoRA merge, else
    bf16: :func:`export_dtype`), ``bf16`` or ``fp32``."""
    export_dtype(dtype, False)  # an unknown dtype: before anything is read
    from npu_train.checkpoint.store import find_checkpoint

    # a step_XXXXXX dir or a checkpoint root (never the trainer's keywords latest/auto)
    arg = arg or f"python -m npu_train.checkpoint.export <checkpoint>={ckpt_dir!r}"
    reader = CheckpointReader(find_checkpoint(os.path.abspath(ckpt_dir), None, arg=arg))
    cfg = LlamaConfig.from_dict(reader.manifest["model"])
    names = stage_param_names(cfg, 0, cfg.num_layers, True, True)
    train = reader.manifest.get("train") or {}
    lora = train.get("mode") == "lora"
    auto, dtype = dtype == "auto", export_dtype(dtype, lora)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    check_memory(export_bound(cfg, lora), f"export of {reader.path}", "free host memory (other processes) and retry")
    model_path = base_model(reader, base, lora)  # before anything is written
    tok_src = tokenizer_source(reader, base, model_path)
    check_out_dir(out_dir, overwrite)
    shapes = dict(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        shapes.update(cfg.param_shapes(i))
    created = not os.path.exists(out_dir)
    top = _first_missing(out_dir)  # the outermost directory makedirs creates (removed again on a refusal)
    make_out_dir(out_dir)
    try:
        check_export_space(out_dir, sum(math.prod(shapes[n]) for n in names) * tdt.itemsize, overwrite)
    except ExportDirError:
        if top:
            shutil.rmtree(top, ignore_errors=True)
        raise
    if overwrite:
        clear_earlier_export(out_dir)
    try:
        _write_export(reader, cfg, names, train, out_dir, dtype, tdt, model_path, tok_src, say, auto)
    except BaseException as e:  # a checkpoint rotated away mid-read, a full disk, Ctrl-C: no partial export stays
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            clear_earlier_export(out_dir)
        if out_of_space(e):  # filled by another process meanwhile (write_stream's errors included)
            raise ExportDirError(f"the disk of {out_dir} filled up during the export (nothing of it is kept): free "
                                 "space there or give another output directory") from None
        raise
    return out_dir


def _copy_generation_config(model_path, out_dir: str) -> None:
    """The trained model's ``generation_config.json`` (its EOS list, sampling defaults) into the export, when the
    model came from an HF directory that has one (GGUF and the embedded model have none)."""
    if not model_path or not os.path.isdir(model_path):
        return
    src = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(src):
        shutil.copyfile(src, os.path.join(out_dir, "generation_config.json"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m npu_train.checkpoint.export",  # as the README runs it
                                 description=__doc__.splitlines()[0].replace("``", ""))
    ap.add_argument("checkpoint", help="a step_XXXXXX checkpoint directory, or a checkpoint root (newest is used)")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="tensor dtype written: auto (the default) is bf16 for full fine-tuning and fp32 for a LoRA "
                         "merge (bf16 can round much of a LoRA update away); fp32 keeps the master weights exactly")
    ap.add_argument("--overwrite", action="store_true",
                    help="export into a non-empty directory: first remove an earlier export's files there "
                         "(model.safetensors, config.json, tokenizer*.json, adapter/), never other files")
    ap.add_argument("--base", default=None,
                    help="LoRA: where the run's base model (its model.path, recorded in the checkpoint) is now, "
                         "when it was moved; checked against the recorded weights")
    a = ap.parse_args(argv)
    from npu_train.metrics.report import fold_long_line  # progress folded at words to 100 columns

    try:
        t0 = time.monotonic()
        out = export_hf(a.checkpoint, a.out, a.dtype, overwrite=a.overwrite, base=a.base,
                        say=lambda text: print(fold_long_line(text), flush=True))
    except Exception as e:  # user-facing CLI: one error, folded within 100 columns (docs/bad-input.md)
        from npu_train.errors import refusal_text

        print(refusal_text(str(e)), file=sys.stderr)
        return 2
    print(fold_long_line(f"exported {a.checkpoint} -> {out} in {time.monotonic() - t0:.0f} s"))
    note = adapter_note(out)
    if note:
        print(fold_long_line(note))
    return 0


def adapter_note(out_dir: str) -> Optional[str]:
    """For a LoRA export (``adapter/`` written): how to load the adapters, and the install line when ``peft``
    is not importable here (``scripts/setup.sh`` leaves it out; docs/lora.md); None for a full export."""
    adir = os.path.join(out_dir, "adapter")
    if not os.path.isfile(os.path.join(adir, "adapter_config.json")):
        return None
    import importlib.util

    tail = "" if importlib.util.find_spec("peft") else (
        "; peft is not installed here: .venv/bin/pip install -e '.[peft]'")
    return (f"  adapter: {adir}, the LoRA adapters in PEFT's layout (peft.PeftModel.from_pretrained(base, "
            f"\"{adir}\")){tail}; model.safetensors is the merged model, loadable without peft")


if __name__ == "__main__":
    sys.exit(main())
