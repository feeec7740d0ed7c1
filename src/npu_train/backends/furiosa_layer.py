"""Whole-layer compiled execution on RNGD (``runtime.furiosa.compiled_layers=true``, off by default).

The default RNGD path runs decoder layers as eager ops: furiosa-torch compiles and loads one
module per distinct op and shape (``furiosa/torch/_backend/eager.py``). This path instead compiles
each decoder layer's forward and backward as two graphs, once per stage (all layers of a stage
share their shapes), written against furiosa-torch 2026.4.0:

1. the layer as a function of its inputs *and weights* (an ``nn.Module`` without parameters that
   calls ``torch.func.functional_call(layer, weights, (h, cos, sin))``), so the graph
   differentiates with respect to the weights;
2. ``furiosa.torch.DfgModule.from_module(fn, cpu_example_args)`` (``_module/dfg.py``: exports it
   with ``torch.export.export(strict=False)`` and imports the data-flow graph; example arguments
   must be CPU tensors of the run's shapes);
3. ``furiosa.torch._backend._autograd.build_autograd_from_module(dfg_module, name=...)`` (a
   furiosa-torch internal; the function its own eager autograd registration uses): differentiates
   the graph (``_C.compiler.differentiate``), compiles forward and backward
   (``differentiated_dfg.compile()``) and returns a ``torch.autograd.Function`` whose ``forward``
   runs the forward graph and saves its activations, ``backward`` the backward graph;
4. each layer's ``forward`` becomes ``Function.apply(h, cos, sin, *weights)`` (an instance
   attribute, so parameter names and checkpoints are unchanged).

Accounting: the compiled graphs allocate their outputs inside the runtime, not through ATen ops,
so the dispatch-mode accounting would not see them; the layer output and every tensor the
Function saves for backward (``torch.autograd.graph.saved_tensors_hooks``) are registered with
the backend's ledger explicitly.

Status (2026-11-30, furiosa-torch 2026.4.0 without a card): step 2 fails for the model's layer:
furiosa-torch's decomposition pass cannot turn the attention output's
``o.transpose(1, 2).reshape(B, S, heads * D)`` (``model/llama.py``) into a view ("Cannot view a
tensor with shape [1, 32, 4, 16] and strides (2048, 16, 512, 1) as (1, 32, 64)"). With that line
written ``torch.einsum("bnsd->bsnd", o).clone(memory_format=torch.contiguous_format).reshape(...)``
(the same values) the graph imports; differentiating and compiling it then did not finish within
600 s on a 2-core machine. ``tests/contract`` records this (xfail); the runbook (step 7e) has the
hardware steps. The switch stays off by default.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

__all__ = ["layer_function", "install_compiled_layers"]


def layer_function(layer: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """``(fn, names)``: ``fn(h, cos, sin, *weights)`` computes ``layer(h, cos, sin)`` with the
    given weights (in ``names`` order, ``layer.named_parameters()``); ``fn`` has no parameters."""
    names = [n for n, _ in layer.named_parameters()]

    class Plain(torch.nn.Module):  # the layer's class forward (its instance forward may be replaced)
        def __init__(self):
            super().__init__()
            self.inner = layer

        def forward(self, h, cos, sin):
            return type(self.inner).forward(self.inner, h, cos, sin)

    plain = Plain()

    class LayerFunction(torch.nn.Module):
        def __init__(self):
            super().__init__()
            object.__setattr__(self, "plain", plain)  # not a submodule: no parameters of its own

        def forward(self, h, cos, sin, *weights):
            params = {f"inner.{n}": w for n, w in zip(names, weights)}
            return torch.func.functional_call(self.plain, params, (h, cos, sin))

    return LayerFunction(), names


def _furiosa_builders() -> tuple[Callable, Callable]:  # pragma: no cover - needs furiosa-torch
    from furiosa.torch import DfgModule
    from furiosa.torch._backend._autograd import build_autograd_from_module

    return DfgModule.from_module, build_autograd_from_module


def install_compiled_layers(module: torch.nn.Module, track: Callable[[torch.Tensor], Any],
                            builders: Optional[tuple[Callable, Callable]] = None) -> int:
    """Make every decoder layer of ``module`` (a :class:`~npu_train.model.llama.StageModule`,
    ``module.model.layers``) run as one compiled forward and one compiled backward graph.

    Args:
        module: the stage module on the card.
        track: the backend's ``track`` (counts a device tensor's storage once).
        builders: ``(dfg_from_module, build_autograd)``; default furiosa-torch's (module
            docstring). Tests pass stand-ins.

    Returns:
        The number of layers switched. The graphs are built at the first call of each input shape
        (the warm-up), once per stage and shape.
    """
    dfg_from_module, build_autograd = builders or _furiosa_builders()
    layers = list(module.model.layers.values())
    cache: dict = {}

    def function_for(layer, h, cos, sin):
        key = (tuple(h.shape), h.dtype, tuple(cos.shape), cos.dtype)
        fn_cls = cache.get(key)
        if fn_cls is None:
            fn, _ = layer_function(layer)
            ws = [p for _, p in layer.named_parameters()]
            example = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in (h, cos, sin, *ws))
            fn_cls = build_autograd(dfg_from_module(fn, example), name="npu_train_decoder_layer")
            cache[key] = fn_cls
        return fn_cls

    for layer in layers:
        def forward(self, h, cos, sin):
            fn_cls = function_for(self, h, cos, sin)
            ws = [p for _, p in self.named_parameters()]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: track(t), lambda t: t):
                out = fn_cls.apply(h, cos, sin, *ws)
            out = out[0] if isinstance(out, (tuple, list)) else out
            track(out)
            return out

        layer.forward = types.MethodType(forward, layer)
    return len(layers)
