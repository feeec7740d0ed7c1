"""A tensor to be written later: name, dtype, shape and how to fetch it (used to stream checkpoints)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Entry:
    """One tensor of a streamed file: ``get()`` returns it (contiguous CPU, ``dtype``, ``shape``)."""
    name: str
    dtype: torch.dtype
    shape: tuple
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()
