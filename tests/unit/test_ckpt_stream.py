"""Streaming shard writer: safetensors-compatible output, one tensor fetched at a time, memory check."""
import os

import pytest
import torch
from safetensors import safe_open

from npu_train.checkpoint.store import save_shard, tmp_dir
from npu_train.checkpoint.stream import Entry, MemoryCheckError, cgroup_headroom, check_memory, write_stream
from npu_train.optim.adamw import StageOptimizer


def test_stream_file_loads_with_safetensors(tmp_path):
    ts = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.uint8), "c": torch.randn(2).bfloat16()}
    p = str(tmp_path / "x.safetensors")
    write_stream(p, [Entry(k, t.dtype, tuple(t.shape), lambda t=t: t) for k, t in ts.items()], {"format": "pt"})
    assert os.path.getsize(p) % 1 == 0
    with safe_open(p, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in ts.items():
            assert torch.equal(f.get_tensor(k), t)


def test_entries_fetched_one_at_a_time(tmp_path):
    live = []

    def getter(k):
        def get():
            live.append(k)
            assert len(live) - len(done) == 1  # the previous tensor was written before this one is fetched
            return torch.full((4,), float(k))
        return get

    done = []
    write_stream(str(tmp_path / "y.safetensors"), [Entry(str(k), torch.float32, (4,), getter(k)) for k in range(5)],
                 visit=lambda n, t: done.append(n))
    assert live == list(range(5))


def _opt():
    params = {"w": torch.nn.Parameter(torch.randn(4, 3)), "v": torch.nn.Parameter(torch.randn(5))}
    from npu_train.backends.cpu import CPUBackend
    b = CPUBackend()
    b.setup()
    opt = StageOptimizer(params, {n: p.detach().clone() for n, p in params.items()}, ["w"], b, lr=0.1,
                         layers=[("L0", ["w", "v"])])
    for p in params.values():
        p.grad = torch.ones_like(p)
    return opt


def test_shard_from_live_state_equals_copies(tmp_path):
    opt = _opt()
    opt.begin_step(1)
    opt.step(0.1, 1.0)
    want = opt.state_tensors()
    entries = opt.state_entries()
    st = tmp_dir(str(tmp_path), 1, "j")
    save_shard(st, 0, entries, {"rank": 0})
    with safe_open(os.path.join(st, "stage_000.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(want)
        for k, t in want.items():
            assert torch.equal(f.get_tensor(k), t)


def test_memory_check_raises_before_work():
    check_memory(10, "x", "fix", available=11)
    with pytest.raises(MemoryCheckError, match="save needs 1.00 GiB.*0.50 GiB.*do this"):
        check_memory(2**30, "save", "do this", available=2**29)


def test_cgroup_headroom(tmp_path):
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("300\n")
    assert cgroup_headroom(str(tmp_path)) == 700
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_headroom(str(tmp_path)) is None


def test_finite_check_needs_no_whole_tensor_temporaries():
    """The save's finiteness check stays within its bound: a 256 MiB fp32 tensor raises the process's
    peak RSS (VmHWM, read by the kernel) by well under its own size (torch.isfinite of the whole tensor:
    about 1.6x it)."""
    import subprocess
    import sys

    code = r'''
import re, torch
from npu_train.checkpoint.store import FiniteCheck
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
t = torch.ones(64 << 20)
t[-1] = float("inf")
bool(torch.isfinite(torch.ones(1 << 22)).all())  # first-call set-up (kernels, thread pool) outside the bound
before = hwm()
c = FiniteCheck(); c.visit("master.w", t)
print(c.finite, hwm() - before)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"
    assert int(out[1]) < 64 << 20, f"finite check grew the peak by {int(out[1]) / 2**20:.0f} MiB"
