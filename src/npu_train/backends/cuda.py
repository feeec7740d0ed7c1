"""CUDA backend: one NVIDIA GPU per process (``cuda:N``). Memory figures: torch's caching allocator
(live tensor bytes, without cached blocks or the CUDA context)."""

from __future__ import annotations

import torch

from npu_train.backends.base import Backend, BackendUnavailableError


class CUDABackend(Backend):
    kind = "cuda"
    memory_accounting = "cuda-caching-allocator"

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.memory_flag_thread_local = True  # CUDA has no process-wide memory-type flag

    def _setup(self) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"{self.name}: CUDA is not available in this process (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); check nvidia-smi / CUDA_VISIBLE_DEVICES, "
                f"or use cpu / furiosa:N")
        n = torch.cuda.device_count()
        if self.index >= n:
            from npu_train.backends.spec import BackendSpecError

            raise BackendSpecError(f"backend entry '{self.name}' names a device that does not exist: "
                                   f"this machine has {n} CUDA devices")
        torch.cuda.set_device(self.index)
        torch.empty(1, device=self.device())  # create the context now, not mid-step

    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def capacity_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def _upload(self, t: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        dev = self.device()
        if t.device == dev:
            return t.clone()
        return t.to(dev, non_blocking=non_blocking)

    def _download(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.device.type == "cpu" else t.to("cpu")
