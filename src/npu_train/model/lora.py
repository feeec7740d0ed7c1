"""LoRA adapters (Hu et al., ICLR 2022): ``y = x W^T + (alpha / r) * dropout(x) A^T B^T`` with ``W`` frozen,
``A`` ``[r, in]`` Kaiming-uniform, ``B`` ``[out, r]`` zero (PEFT's layout and init; names
``<linear>.lora_A.weight``). ``A`` is seeded by ``(seed, HF name)``, independent of the split.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from npu_train.config import LORA_TARGETS as ALL_TARGETS  # Llama's projections, PEFT's names


@dataclass(frozen=True)
class LoraSpec:
    """Adapter settings: rank ``r``, ``alpha`` (scaling = alpha / r), ``dropout`` probability on the
    adapter input, and the ``targets`` (short module names, a subset of :data:`ALL_TARGETS`; on a sparse layer an
    MLP target adapts every expert's projection, Mixtral's ``w1`` / ``w3`` / ``w2`` for ``gate_proj`` / ``up_proj`` /
    ``down_proj``, and Qwen2-MoE's shared expert's)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = ALL_TARGETS
    #: mixtures of experts: routers (``gate``, ``shared_expert_gate``) trained in full, not frozen
    train_router: bool = False

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
        """``x W^T + b + scaling * (dropout(x) A^T) B^T``: the adapter's product is added into the base output in
        place (``addmm_``), so the forward leaves no ``[..., out]`` temporaries behind (``y + B(A(x)) * s`` left three
        per projection, which stood as holes in a cpu card's heap: one process, 15 SmolLM2-135M layers, S=256, b=2,
        two micro-batches in flight: 0.83-0.90 GiB of holes for 0.66 GiB of activations, now 0.38-0.43;
        ``experiments/2026-12-06-plan-bound.md``)."""
        if not self.adapter_enabled:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        y = F.linear(x2, self.weight, self.bias)
        y.addmm_(self.lora_A(self.dropout(x2)), self.lora_B.weight.t(), alpha=self.scaling)
        return y.view(*x.shape[:-1], self.out_features)


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


#: Mixtral's expert projection names -> the target names (PEFT's and the other families')
_TARGET_OF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: router weights (sparse layers) trained in full with ``LoraSpec.train_router``
ROUTER_LEAVES = ("gate", "shared_expert_gate")


def target_of(module_name: str) -> str:
    """The LoRA target name of the linear ``module_name`` (its last component; Mixtral's ``w1`` -> ``gate_proj``)."""
    leaf = module_name.rsplit(".", 1)[-1]
    return _TARGET_OF.get(leaf, leaf)


def is_router(name: str) -> bool:
    """True for a sparse layer's router weight (``...mlp.gate.weight``, ``...shared_expert_gate.weight``)."""
    return name.endswith(".weight") and name[: -len(".weight")].rsplit(".", 1)[-1] in ROUTER_LEAVES


def apply_lora(module: nn.Module, spec: LoraSpec, seed: int, base: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Replace the target linears of every decoder layer of ``module`` (every expert's, on a sparse layer) by
    :class:`LoraLinear`, freeze the rest (the routers stay trainable with ``spec.train_router``); returns the fp32
    initial values of what trains ``{hf_name: tensor}`` (adapters; routers: ``base[name]``, the fp32 weights, when
    given, else the module's). ``ValueError`` for an unknown target."""
    bad = [t for t in spec.targets if t not in ALL_TARGETS]
    if bad:
        raise ValueError(f"unknown LoRA target(s) {bad}: use a subset of {list(ALL_TARGETS)}")
    for p in module.parameters():
        p.requires_grad_(False)
    init: dict[str, torch.Tensor] = {}
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")]
    for prefix, lin in linears:
        if target_of(prefix) not in spec.targets or is_router(prefix + ".weight"):
            continue
        new = LoraLinear(lin, spec)
        a, b = init_adapter(f"{prefix}.weight", tuple(new.lora_A.weight.shape), tuple(new.lora_B.weight.shape), seed)
        with torch.no_grad():
            new.lora_A.weight.copy_(a)
            new.lora_B.weight.copy_(b)
        init[f"{prefix}.lora_A.weight"], init[f"{prefix}.lora_B.weight"] = a, b
        parent_name, _, leaf = prefix.rpartition(".")
        setattr(module.get_submodule(parent_name), leaf, new)
    if spec.train_router:
        for n, p in module.named_parameters():
            if n.startswith("model.layers.") and is_router(n):
                p.requires_grad_(True)
                init[n] = base[n].float() if base is not None and n in base else p.detach().float().clone()
    return init


def lora_param_names(layer: int, targets: Iterable[str], cfg=None, train_router: bool = False) -> list[str]:
    """HF names of what trains in global decoder layer ``layer`` for ``targets``: adapters (every expert's on a
    sparse layer of ``cfg``; without ``cfg``, a dense layer's) and, with ``train_router``, the routers."""
    if cfg is None:
        out = []
        for t in ALL_TARGETS:
            if t in targets:
                parent = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                out += [f"model.layers.{layer}.{parent}.{t}.lora_A.weight",
                        f"model.layers.{layer}.{parent}.{t}.lora_B.weight"]
        return out
    return list(adapter_shapes(cfg, layer, LoraSpec(targets=tuple(targets), train_router=train_router)))


def adapter_shapes(cfg, layer: int, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """``{HF name: shape}`` of what trains in decoder layer ``layer`` of ``cfg``: ``lora_A`` ``[r, in]`` and
    ``lora_B`` ``[out, r]`` of each target linear (in the layer's parameter order), the routers with
    ``spec.train_router``."""
    out: dict[str, tuple[int, ...]] = {}
    for n, shape in cfg.param_shapes(layer).items():
        if len(shape) != 2:
            continue
        if is_router(n):
            if spec.train_router:
                out[n] = tuple(shape)
            continue
        stem = n[: -len(".weight")]
        if target_of(stem) in spec.targets:
            out[f"{stem}.lora_A.weight"] = (spec.r, shape[1])
            out[f"{stem}.lora_B.weight"] = (shape[0], spec.r)
    return out


def is_adapter(name: str) -> bool:
    """True for LoRA adapter parameter names (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def fuses_experts(spec: LoraSpec, family: str) -> bool:
    """True where PEFT 0.21 fuses the experts' gate and up adapters when it loads them onto transformers 5's
    stacked experts (a mixture-of-experts ``family`` with ``gate_proj`` or ``up_proj`` targeted): one LoRA of rank
    ``2 r`` on ``gate_up_proj`` (``A = [A_gate; A_up]``, ``B`` block-diagonal), wrapped inside the one on
    ``down_proj``."""
    from npu_train.model.config import MOE_FAMILIES

    return family in MOE_FAMILIES and bool({"gate_proj", "up_proj"} & set(spec.targets))


def _expert_adapters(adapters: dict[str, torch.Tensor], r: int, family: str) -> dict[str, torch.Tensor]:
    """Every expert's gate, up and down adapters as PEFT 0.21 fuses them (see :func:`peft_state_dict`): the ones in
    ``adapters`` (names ``<prefix>.experts.<e>.<proj>.lora_{A,B}.weight``; A [r, in], B [out, r]), a missing gate
    or up one zero (shapes of its partner's), ``down_proj``'s padded with zeros to rank ``2 r`` (A [2 r, I],
    B [h, 2 r]; ``B @ A`` unchanged), zero where missing."""
    experts: dict[str, dict[tuple, torch.Tensor]] = {}
    for n, t in adapters.items():
        module, part = n.split(".lora_", 1)
        prefix, leaf = module.rsplit(".", 1)
        experts.setdefault(prefix, {})[(target_of(leaf), part[0])] = t
    inv = {v: k for k, v in _TARGET_OF.items()}
    leaves = {t: inv[t] if family == "mixtral" else t for t in ("gate_proj", "up_proj", "down_proj")}
    out = {}
    for prefix, got in experts.items():
        a = got.get(("gate_proj", "A"), got.get(("up_proj", "A")))  # [r, h]
        b = got.get(("gate_proj", "B"), got.get(("up_proj", "B")))  # [I, r]
        (h, inter), z = (a.shape[1], b.shape[0]), a.new_zeros
        for t in ("gate_proj", "up_proj"):
            out[f"{prefix}.{leaves[t]}.lora_A.weight"] = got.get((t, "A"), z(r, h))
            out[f"{prefix}.{leaves[t]}.lora_B.weight"] = got.get((t, "B"), z(inter, r))
        down = leaves["down_proj"]
        out[f"{prefix}.{down}.lora_A.weight"] = torch.cat([got.get(("down_proj", "A"), z(r, inter)), z(r, inter)])
        out[f"{prefix}.{down}.lora_B.weight"] = torch.cat([got.get(("down_proj", "B"), z(h, r)), z(h, r)], 1)
    return out


def peft_state_dict(adapters: dict[str, torch.Tensor], spec: LoraSpec, family: str = "llama"
                    ) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's file keys (``base_model.model.`` + HF name; experts one adapter each, as
    transformers 4 named them, which PEFT 0.21 fuses onto transformers 5's stacked experts when it loads them);
    trained routers under their module names in transformers 5 (Mixtral's ``block_sparse_moe`` is ``mlp``), as
    PEFT saves ``modules_to_save``.

    Where :func:`fuses_experts`, the experts' adapters are written as PEFT 0.21 can load them
    (:func:`_expert_adapters`): its fused ``gate_up_proj`` adapter has rank ``2 r``, and :func:`peft_config`
    declares every expert parameter at that rank (no ``rank_pattern`` on parameters: PEFT 0.21 warns that such keys
    "did not match any targeted module", though it uses them), so ``down_proj``'s adapter is padded to rank
    ``2 r`` with zeros; PEFT fuses gate and up only both together (it refuses one alone) and loads them only inside
    a ``down_proj`` adapter (alone, they are "missing adapter keys", silently no effect), so a projection not
    targeted gets a zero adapter."""
    experts = {}
    if fuses_experts(spec, family):
        experts = _expert_adapters({n: t for n, t in adapters.items() if is_adapter(n) and ".experts." in n}, spec.r,
                                   family)
    out = {f"base_model.model.{n}": t for n, t in adapters.items() if is_adapter(n) and n not in experts}
    out.update({f"base_model.model.{n}": t for n, t in experts.items()})
    out.update({f"base_model.model.{n.replace('.block_sparse_moe.', '.mlp.')}": t
                for n, t in adapters.items() if is_router(n)})
    return out


def peft_config(spec: LoraSpec, base_model: str, family: str = "llama") -> dict:
    """``adapter_config.json`` contents for ``peft.PeftModel.from_pretrained`` (Mixtral's experts: target names
    ``w1`` / ``w3`` / ``w2``; trained routers: ``modules_to_save``).

    Where :func:`fuses_experts`, in transformers 5's terms, which PEFT 0.21 loads without converting the config:
    ``target_parameters`` ``gate_up_proj`` and ``down_proj`` at rank ``2 r`` and alpha ``2 alpha`` (the same
    scaling), the attention targets in ``target_modules`` with ``rank_pattern`` / ``alpha_pattern`` ``r`` /
    ``alpha``. The transformers 4 form (``gate_proj`` ... in ``target_modules``) makes PEFT add a ``rank_pattern``
    key ``.*\\.gate_up_proj`` that its own check then reports as matching no module (a ``RuntimeWarning`` on every
    load). The per-expert tensors keep transformers 4's names in both forms (:func:`peft_state_dict`)."""
    targets = list(spec.targets)
    if family == "mixtral":
        inv = {v: k for k, v in _TARGET_OF.items()}
        targets = [inv.get(t, t) for t in targets]
    # only the routers the family has (Qwen2-MoE alone has a shared expert's gate)
    save = [r for r in ROUTER_LEAVES if r != "shared_expert_gate" or family == "qwen2_moe"] if spec.train_router else None
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.r, "lora_alpha": spec.alpha,
           "lora_dropout": spec.dropout, "target_modules": targets, "bias": "none",
           "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
           "init_lora_weights": True, "modules_to_save": save, "use_rslora": False, "use_dora": False}
    if fuses_experts(spec, family):
        attn = [t for t in targets if target_of(t) not in ("gate_proj", "up_proj", "down_proj")]
        out.update(r=2 * spec.r, lora_alpha=2 * spec.alpha, target_modules=attn,
                   target_parameters=["gate_up_proj", "down_proj"],
                   rank_pattern={t: spec.r for t in attn}, alpha_pattern={t: spec.alpha for t in attn})
    return out


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], spec: LoraSpec,
                   names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Merged weights ``W + s * B @ A`` (fp32) for the HF weight ``names`` that have adapters, a trained router's
    own weight where ``adapters`` holds it; others as given."""
    out = {}
    for n in names:
        if n in adapters:
            out[n] = adapters[n].float()
            continue
        w = base[n].float()
        stem = n[: -len(".weight")]
        a, b = adapters.get(f"{stem}.lora_A.weight"), adapters.get(f"{stem}.lora_B.weight")
        if a is not None and b is not None:  # one pass over W (w + s * (b @ a) made 3 W-sized tensors)
            w = torch.addmm(w, b.float(), a.float(), alpha=spec.scaling)
        out[n] = w
    return out
