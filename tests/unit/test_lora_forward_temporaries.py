"""A LoRA projection's forward allocates one output-sized tensor: the adapter's product goes into the base output in
place, so no freed ``[..., out]`` temporaries stand as holes in a cpu card's heap (issue 43)."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from npu_train.model.lora import LoraLinear, LoraSpec


class _NewStorages(TorchDispatchMode):
    """Counts the storages of at least ``numel`` elements the ops inside create (not ``existing`` tensors')."""

    def __init__(self, numel: int, existing=()):
        super().__init__()
        self.numel, self.big = numel, 0
        self.seen = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                key = t.untyped_storage().data_ptr()
                if key not in self.seen:
                    self.seen.add(key)
                    self.big += 1
        return out


def test_forward_makes_one_output_sized_tensor_and_the_lora_sum():
    torch.manual_seed(0)
    base = nn.Linear(64, 96, bias=True)
    lin = LoraLinear(base, LoraSpec(r=4, alpha=8, targets=("q_proj",)))
    with torch.no_grad():
        lin.lora_B.weight.normal_()
    x = torch.randn(2, 8, 64, requires_grad=True)
    with _NewStorages(2 * 8 * 96, [x, *lin.parameters()]) as mode:
        y = lin(x)
    assert mode.big == 1, mode.big  # y + B(A(x)) * s made 4: the base output, B's, the scaled, the sum
    ref = base(x) + (x @ lin.lora_A.weight.t() @ lin.lora_B.weight.t()) * lin.scaling
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    assert lin.lora_A.weight.grad is not None and lin.lora_B.weight.grad is not None and x.grad is not None
