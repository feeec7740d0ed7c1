"""LoRA adapters (Hu et al., ICLR 2022): ``y = x W^T + (alpha / r) * dropout(x) A^T B^T`` with ``W`` frozen,
``A`` ``[r, in]`` Kaiming-uniform, ``B`` ``[out, r]`` zero (PEFT's layout and init; names
``<linear>.lora_A.weight``). ``A`` is seeded by ``(seed, HF name)``, independent of the split.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from npu_train.config import LORA_TARGETS as ALL_TARGETS  # Llama's projections, PEFT's names


@dataclass(frozen=True)
class LoraSpec:
    """Adapter settings: rank ``r``, ``alpha`` (scaling = alpha / r), ``dropout`` probability on the
    adapter input, and the ``targets`` (short module names, a subset of :data:`ALL_TARGETS`)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = ALL_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def params_per_layer(self, hidden: int, intermediate: int, q_out: int, kv_out: int) -> int:
        """Trainable adapter parameters of one decoder layer: sum over targets of ``r * (in + out)``."""
        dims = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
                "o_proj": (q_out, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                "down_proj": (intermediate, hidden)}
        return sum(self.r * (dims[t][0] + dims[t][1]) for t in self.targets)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus a LoRA adapter: ``weight`` (frozen), ``bias`` [out] (frozen, Qwen2's q/k/v;
    None when the base has none: PEFT's ``bias="none"``), ``lora_A.weight`` [r, in], ``lora_B.weight`` [out, r].
    ``forward(x [..., in]) -> [..., out]``."""

    def __init__(self, base: nn.Linear, spec: LoraSpec):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.lora_A = nn.Linear(self.in_features, spec.r, bias=False, device=base.weight.device,
                                dtype=base.weight.dtype)
        self.lora_B = nn.Linear(spec.r, self.out_features, bias=False, device=base.weight.device,
                                dtype=base.weight.dtype)
        with torch.no_grad():
            self.lora_B.weight.zero_()  # B = 0: the adapted layer equals the base layer until trained
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        #: False: the frozen base layer alone (the DPO reference pass, :func:`adapters_disabled`)
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Within the block every :class:`LoraLinear` of ``module`` computes its frozen base layer alone (PEFT's
    ``disable_adapter()``): the base model, without a second copy of its weights."""
    layers = [m for m in module.modules() if isinstance(m, LoraLinear)]
    for m in layers:
        m.adapter_enabled = False
    try:
        yield len(layers)
    finally:
        for m in layers:
            m.adapter_enabled = True


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_adapter(name: str, shape_a: tuple, shape_b: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial fp32 ``(A, B)`` of the adapter of HF weight ``name``: ``A ~ U(±1 / sqrt(in))`` (PEFT's
    Kaiming-uniform, ``a = sqrt(5)``), ``B = 0``."""
    g = torch.Generator().manual_seed(_seed_of(seed, name))
    fan_in = shape_a[1]
    bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))  # kaiming_uniform_(a=sqrt(5)) = 1/sqrt(fan_in)
    a = (torch.rand(shape_a, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()
    return a, torch.zeros(shape_b)


def apply_lora(module: nn.Module, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """Replace the target linears of every decoder layer of ``module`` by :class:`LoraLinear`, freeze the rest;
    returns the fp32 initial adapters ``{hf_name: tensor}``. ``ValueError`` for an unknown target."""
    bad = [t for t in spec.targets if t not in ALL_TARGETS]
    if bad:
        raise ValueError(f"unknown LoRA target(s) {bad}: use a subset of {list(ALL_TARGETS)}")
    for p in module.parameters():
        p.requires_grad_(False)
    init: dict[str, torch.Tensor] = {}
    for idx, layer in module.model.layers.items():
        for parent_name, parent in (("self_attn", layer.self_attn), (layer.mlp_name, layer.ffn)):
            for t in spec.targets:
                lin = getattr(parent, t, None)
                if lin is None:
                    continue
                new = LoraLinear(lin, spec)
                prefix = f"model.layers.{idx}.{parent_name}.{t}"
                a, b = init_adapter(f"{prefix}.weight", tuple(new.lora_A.weight.shape), tuple(new.lora_B.weight.shape),
                                    seed)
                with torch.no_grad():
                    new.lora_A.weight.copy_(a)
                    new.lora_B.weight.copy_(b)
                init[f"{prefix}.lora_A.weight"], init[f"{prefix}.lora_B.weight"] = a, b
                setattr(parent, t, new)
    return init


def lora_param_names(layer: int, targets: Iterable[str]) -> list[str]:
    """HF names of the adapter parameters of global decoder layer ``layer`` for ``targets``."""
    out = []
    for t in ALL_TARGETS:
        if t in targets:
            parent = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out += [f"model.layers.{layer}.{parent}.{t}.lora_A.weight", f"model.layers.{layer}.{parent}.{t}.lora_B.weight"]
    return out


def is_adapter(name: str) -> bool:
    """True for LoRA adapter parameter names (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's file keys (``base_model.model.`` + HF name)."""
    return {f"base_model.model.{n}": t for n, t in adapters.items() if is_adapter(n)}


def peft_config(spec: LoraSpec, base_model: str) -> dict:
    """``adapter_config.json`` contents for ``peft.PeftModel.from_pretrained``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.r, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": list(spec.targets), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
            "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False}


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], spec: LoraSpec,
                   names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Merged weights ``W + s * B @ A`` (fp32) for the HF weight ``names`` that have adapters; others as given."""
    out = {}
    for n in names:
        w = base[n].float()
        stem = n[: -len(".weight")]
        a, b = adapters.get(f"{stem}.lora_A.weight"), adapters.get(f"{stem}.lora_B.weight")
        if a is not None and b is not None:
            w = w + spec.scaling * (b.float() @ a.float())
        out[n] = w
    return out
