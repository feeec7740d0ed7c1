"""Card processes keep freed host memory for reuse (npu_train.hostmem): a large tensor allocated
again after it was freed comes back without page faults; the user's own glibc settings win."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from npu_train.hostmem import card_mmap_threshold, keep_freed_memory

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                           reason="glibc malloc settings (Linux only)")

#: a step's pattern of fp32 tensors (64, 4, 16, 64 and 8 MiB) allocated, written and freed 12 times
#: (torch's posix_memalign blocks settle in glibc's heap after ~8 repetitions), then 5 more: their
#: minor page faults. glibc's defaults: ~166,000 (each block above the mmap threshold is its own
#: mapping; the heap top is trimmed on free); only the mmap threshold set: ~82,000; only the trim
#: threshold: ~200,000; both: 0.
PROG = r"""
import json, resource, sys
from npu_train.hostmem import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
import torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    xs = [torch.ones(n) for n in (16 << 20, 1 << 20, 4 << 20, 16 << 20, 2 << 20)]
    while xs:
        del xs[-1]
for _ in range(12):
    step()
f0 = faults()
for _ in range(5):
    step()
print(json.dumps({"applied": applied, "faults": faults() - f0}))
"""


def _run(mode: str, **env) -> dict:
    e = {**os.environ, **env}
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        if k not in env:
            e.pop(k, None)
    out = subprocess.run([sys.executable, "-c", PROG, mode], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_freed_memory_is_reused_without_page_faults():
    default = _run("default")
    kept = _run("keep")
    assert kept["applied"] is True
    # glibc default: fresh pages for the big blocks every time (each 64 MiB one is 16,384 pages)
    assert default["faults"] > 5 * 2 * 16384 * 0.9, default
    assert kept["faults"] < 1000, kept


@glibc
def test_the_users_own_glibc_settings_win():
    got = _run("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert got["applied"] is False
    assert got["faults"] > 5 * 2 * 16384 * 0.9, got  # nothing changed: still a fresh block each time


def test_not_applied_when_the_user_set_it():
    assert keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "1"}) is False


def test_card_processes_get_the_setting_by_default():
    from npu_train.config import RuntimeConf
    from npu_train.runtime.spec import RuntimeSpec

    assert RuntimeConf().keep_host_memory is True
    assert RuntimeSpec(heartbeat_interval_s=1.0, transport="shm", threads=1).keep_host_memory is True


def test_glibc_tunables_for_malloc_count_as_the_users_setting():
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}) is False


#: a cpu card that returns freed memory: a freed 64 MiB tensor leaves the process (with the 1 GiB threshold of
#: an accelerator card keeping it, it stays on the heap)
RETURN_PROG = r"""
import json, sys, torch
from npu_train.hostmem import card_mmap_threshold, keep_freed_memory
applied = keep_freed_memory(mmap_threshold=card_mmap_threshold(sys.argv[1], keep=sys.argv[2] != "return",
                                                             recompute=sys.argv[2] == "recompute"))
def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024
xs = [torch.ones(1 << 20) for _ in range(64)]  # 64 tensors of 4 MiB, like a stage's activations
del xs[::2]
before = anon()
del xs
print(json.dumps({"applied": applied, "freed": before - anon()}))
"""


def test_card_mmap_threshold_policy():
    # every card keeps blocks up to 1 GiB on the heap (glibc's dynamic threshold stops at 32 MiB: the head's
    # [tokens, vocab] tensors were mapped afresh each micro-batch); a cpu card's plan counts the heap's holes
    assert card_mmap_threshold("cpu") == 1 << 30 and card_mmap_threshold("cpu", keep=False) == 256 * 1024
    assert card_mmap_threshold("furiosa") == 1 << 30 and card_mmap_threshold("cuda", keep=False) is None
    # activation recompute (chosen when nothing else fits): a cpu card returns freed memory, whatever keep says
    # (issue 43: the recomputed layers' freed temporaries stayed on the heap, a micro-batch's activations)
    assert card_mmap_threshold("cpu", recompute=True) == card_mmap_threshold("cpu", keep=False, recompute=True) == 256 * 1024
    assert card_mmap_threshold("furiosa", recompute=True) == 1 << 30


@glibc
def test_cpu_card_returns_freed_tensors():
    def run(kind, keep):
        e = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
        out = subprocess.run([sys.executable, "-c", RETURN_PROG, kind, keep], env=e, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    cpu, furiosa, cpu_keep = run("cpu", "return"), run("furiosa", "keep"), run("cpu", "keep")
    cpu_rc = run("cpu", "recompute")
    assert cpu["applied"] is True and furiosa["applied"] is True and cpu_keep["applied"] is True
    assert cpu["freed"] >= 120 << 20, cpu  # the 32 remaining tensors' 128 MiB went back to the OS
    assert cpu_rc["freed"] >= 120 << 20, cpu_rc  # likewise under recompute
    assert furiosa["freed"] < 8 << 20, furiosa  # kept on the heap for reuse (the accelerators' host side)
    assert cpu_keep["freed"] < 8 << 20, cpu_keep  # likewise on a cpu card by default


#: a stage's pattern: 4 MiB "activations" with a 4 KiB live block ("a gradient") after each; the big ones freed
#: stay as 128 MiB of holes (the live blocks keep them from the heap's top). Then 16 of them allocated again, written
#: and freed: 64 MiB freed after the guard's check.
GUARD_PROG = r"""
import json, sys, torch
from npu_train.hostmem import HeapGuard, keep_freed_memory
keep_freed_memory()
guard = HeapGuard.create(int(sys.argv[1]), 0, None if sys.argv[2] == "none" else int(sys.argv[2]))
xs = []
for _ in range(32):
    xs.append(torch.ones(1 << 20))
    xs.append(torch.ones(1024))
small = xs[1::2]
del xs
before = guard.holes()
guard.check()
after = guard.holes()
ys = [torch.ones(1 << 20) for _ in range(16)]
del ys
print(json.dumps({"before": before, "after": after, "refreed": guard.holes(), "trims": guard.trims, "full": guard.full,
                  "checks": guard.checks}))
"""


def _guard(cap: int, limit=None) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", GUARD_PROG, str(cap), str(limit).lower()], env=e, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_heap_guard_returns_holes_past_its_cap():
    """``HeapGuard.check`` trims when the holes (anonymous RSS - live malloc bytes, from its arming) exceed the cap:
    128 MiB of freed 4 MiB blocks pinned by live 4 KiB ones are holes; cap 0 returns them (a page per free chunk may
    stay), a 1 GiB cap keeps them. After the trim, holes grow by at most the bytes freed since (64 MiB)."""
    from npu_train.hostmem import heap_guard_available

    assert heap_guard_available()
    MiB = 1 << 20
    trimmed, kept = _guard(0), _guard(1 << 30)
    for g in (trimmed, kept):
        assert 120 * MiB <= g["before"] <= 136 * MiB, g
        assert g["checks"] == 1
    assert trimmed["trims"] == 1 and trimmed["after"] < 4 * MiB, trimmed
    assert kept["trims"] == 0 and kept["after"] >= 120 * MiB, kept
    assert trimmed["refreed"] - trimmed["after"] <= 64 * MiB + 2 * MiB, trimmed
    # with a limit: no trim while the RSS is below it (a card: its plan's total less slack and one layer's frees)
    below, above = _guard(0, 1 << 40), _guard(0, 0)
    assert below["trims"] == 0 and below["after"] >= 120 * MiB, below
    assert below["full"] == 0  # below the limit the live bytes (mallinfo2) are not even read
    assert above["trims"] == 1 and above["after"] < 4 * MiB, above


def test_heap_guard_cap_is_checked():
    from npu_train.hostmem import HeapGuard

    with pytest.raises(ValueError, match="cap_bytes=-1"):
        HeapGuard.create(-1)
