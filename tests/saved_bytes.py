"""What autograd keeps for one decoder layer's backward, counted by storage: :func:`saved_layer_bytes`, the
measurement the planner's activation figures (``planner/memory.py``) are checked against."""
from __future__ import annotations

import contextlib

import torch


def saved_layer_bytes(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args, kernel=None) -> int:
    """Bytes of the unique storages autograd saves in ``layer(x, cos, sin, *args)`` (the layer's parameters and the
    RoPE tables ``cos`` / ``sin`` left out, as the planner's figures do); ``kernel``: an ``SDPBackend`` to force
    through ``torch.nn.attention.sdpa_kernel`` (None: PyTorch's own choice)."""
    skip = {p.untyped_storage()._cdata for p in layer.parameters()} | {cos.untyped_storage()._cdata,
                                                                       sin.untyped_storage()._cdata}
    seen: dict = {}

    def pack(t):
        if t.untyped_storage()._cdata not in skip:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    ctx = contextlib.nullcontext() if kernel is None else torch.nn.attention.sdpa_kernel(kernel)
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, *args)
    return sum(seen.values())
