"""Whole-layer compiled execution on RNGD (``runtime.furiosa.compiled_layers=true``, off by default): each
decoder layer's forward and backward as two compiled graphs. Not yet working on furiosa-torch 2026.4.0
(``tests/contract`` xfail); the steps and their status: docs/furiosa.md. Packed rows (``data.pack``,
``data.doc_mask``) pass the block-diagonal causal mask ``[B, 1, S, S]`` (additive, compute dtype) as one more graph input (and
``cos``/``sin`` ``[B, 1, S, D]``): a second pair of graphs per shape, built at the first packed micro-batch.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

__all__ = ["layer_function", "install_compiled_layers"]


def layer_function(layer: torch.nn.Module, masked: bool = False) -> tuple[torch.nn.Module, list[str]]:
    """``(fn, names)``: ``fn(h, cos, sin, *weights)`` computes ``layer(h, cos, sin)`` with the
    given weights (in ``names`` order, ``layer.named_parameters()``); ``fn`` has no parameters.
    ``masked``: ``fn(h, cos, sin, mask, *weights)`` computes ``layer(h, cos, sin, mask)`` (packed rows)."""
    names = [n for n, _ in layer.named_parameters()]
    n_in = 4 if masked else 3

    class Plain(torch.nn.Module):  # the layer's class forward (its instance forward may be replaced)
        def __init__(self):
            super().__init__()
            self.inner = layer

        def forward(self, *inputs):
            return type(self.inner).forward(self.inner, *inputs)

    plain = Plain()

    class LayerFunction(torch.nn.Module):
        def __init__(self):
            super().__init__()
            object.__setattr__(self, "plain", plain)  # not a submodule: no parameters of its own

        def forward(self, *args):
            params = {f"inner.{n}": w for n, w in zip(names, args[n_in:])}
            return torch.func.functional_call(self.plain, params, tuple(args[:n_in]))

    return LayerFunction(), names


def _furiosa_builders() -> tuple[Callable, Callable]:  # pragma: no cover - needs furiosa-torch
    from furiosa.torch import DfgModule
    from furiosa.torch._backend._autograd import build_autograd_from_module

    return DfgModule.from_module, build_autograd_from_module


def install_compiled_layers(module: torch.nn.Module, track: Callable[[torch.Tensor], Any],
                            builders: Optional[tuple[Callable, Callable]] = None) -> int:
    """Run every decoder layer of ``module`` as one compiled forward and one backward graph (built per input
    shape on first call); returns the layers switched. ``builders``: furiosa-torch's by default."""
    dfg_from_module, build_autograd = builders or _furiosa_builders()
    layers = list(module.model.layers.values())
    cache: dict = {}

    def function_for(layer, inputs):
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        fn_cls = cache.get(key)
        if fn_cls is None:
            fn, _ = layer_function(layer, masked=len(inputs) == 4)
            ws = [p for _, p in layer.named_parameters()]
            example = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in (*inputs, *ws))
            fn_cls = build_autograd(dfg_from_module(fn, example), name="npu_train_decoder_layer")
            cache[key] = fn_cls
        return fn_cls

    for layer in layers:
        def forward(self, h, cos, sin, mask=None):
            inputs = (h, cos, sin) if mask is None else (h, cos, sin, mask)
            fn_cls = function_for(self, inputs)
            ws = [p for _, p in self.named_parameters()]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: track(t), lambda t: t):
                out = fn_cls.apply(*inputs, *ws)
            out = out[0] if isinstance(out, (tuple, list)) else out
            track(out)
            return out

        layer.forward = types.MethodType(forward, layer)
    return len(layers)
