"""Wiring of the host-optimizer overlap into a stage's module: the forward through each layer (``embed``,
``layer<i>``, ``head``) waits for that layer's pending host update only (:mod:`npu_train.optim.hooks`).
"""
from __future__ import annotations

import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_key(name: str) -> str:
    """The layer of HF parameter ``name``: ``"embed"``, ``"layer<i>"`` or ``"head"``."""
    m = _LAYER.match(name)
    if m:
        return f"layer{int(m.group(1))}"
    return "embed" if name.startswith("model.embed_tokens.") else "head"


def _order(key: str) -> tuple:
    return (0, 0) if key == "embed" else (2, 0) if key == "head" else (1, int(key[5:]))


def layer_groups(names) -> list[tuple[str, list[str]]]:
    """``[(layer_key, [names...]), ...]`` in forward order (the parameters' order kept within a layer)."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(layer_key(n), []).append(n)
    return sorted(out.items(), key=lambda kv: _order(kv[0]))


def layer_modules(module) -> dict:
    """``{layer_key: submodule}`` whose forward first uses that layer's parameters (``head``: the final norm)."""
    mods = {f"layer{int(i)}": m for i, m in module.model.layers.items()}
    if getattr(module, "has_embed", False):
        mods["embed"] = module.model.embed_tokens
    if getattr(module, "has_head", False):
        mods["head"] = module.model.norm
    elif getattr(module, "vocab", None) is not None:  # vocabulary-parallel: the V(m) waits itself (VocabWork)
        mods["head"] = module.lm_head
    return mods


def install_waits(module, opt, keys) -> None:
    """Register ``opt.wait_layer(key)`` as each layer's layer-ready hook. Raises KeyError for a key without a
    module."""
    mods = layer_modules(module)
    for k in keys:
        opt.hooks.on_layer_ready(mods[k], lambda k=k: opt.wait_layer(k))
