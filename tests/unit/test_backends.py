"""Unit tests for npu_train.backends (main .venv: torch CPU, no furiosa-torch).

The furiosa backend is exercised against a fake ``furiosa.torch`` package injected into
``sys.modules``. Its names mirror the real furiosa-torch 2026.4.0 API (see docs/furiosa.md):
``set_fusion``/``get_fusion``/``Fusion``, ``MeshKind.Single``,
``set_mesh_kind``, ``get_available_devices``, ``exchange_device``, ``is_available``,
``current_stream``/``default_stream`` -> ``Stream.synchronize``, and
``furiosa.torch._C.memory.{MemoryType, _get_memory_type, _set_memory_type}``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import pickle
import sys
import threading
import types

import psutil
import pytest
import torch

from npu_train.backends import (
    AllocLock,
    BackendSpecError,
    BackendUnavailableError,
    FURIOSA_CAPACITY_BYTES,
    make_backend,
    parse_backend_list,
    resolve_cards,
)
from npu_train.backends import accounting as acct
from npu_train.backends import furiosa as fur
from npu_train.backends.furiosa_compile import FURIOSA_LOGGER, FuriosaCompileOptions
from npu_train.backends.cpu import CPUBackend
from npu_train.backends.cuda import CUDABackend
from npu_train.backends.furiosa import FuriosaBackend
from npu_train.hardware import Card

VALID_HINT = "use cpu, cuda:N, cuda:auto, furiosa:N or furiosa:auto"
# In the main .venv nothing imports furiosa-torch; where it is installed, `import torch` already
# loads it (torch.backends entry point) and renames PrivateUse1 to "furiosa".
FURIOSA_PREIMPORTED = sys.modules.get("furiosa.torch") is not None
PU1 = torch._C._get_privateuse1_backend_name()


# ============================================================================ parsing
@pytest.mark.parametrize(
    "value, expected",
    [
        ("cpu", [("cpu", None)]),
        (["cpu", "cpu"], [("cpu", None), ("cpu", None)]),
        ("cuda", [("cuda", None)]),
        ("cuda:0", [("cuda", 0)]),
        ("cuda:auto", [("cuda", None)]),
        ("CUDA:3", [("cuda", 3)]),
        ("furiosa:0", [("furiosa", 0)]),
        ("furiosa:auto", [("furiosa", None)]),
        ("furiosa", [("furiosa", None)]),
        ("rngd:1", [("furiosa", 1)]),
        ("rngd:auto", [("furiosa", None)]),
        (" furiosa:0 , furiosa:1 ", [("furiosa", 0), ("furiosa", 1)]),
        (["furiosa:0", "furiosa:auto", "cpu"], [("furiosa", 0), ("furiosa", None), ("cpu", None)]),
        (("cuda:1", "cuda:0"), [("cuda", 1), ("cuda", 0)]),
        (["furiosa:0,furiosa:1"], [("furiosa", 0), ("furiosa", 1)]),
    ],
)
def test_parse_valid(value, expected):
    reqs = parse_backend_list(value)
    assert [(r.kind, r.index) for r in reqs] == expected
    assert all(isinstance(r, Card) for r in reqs)


def test_parse_keeps_original_text_and_is_frozen():
    reqs = parse_backend_list(" rngd:1 ,cuda:auto")
    assert [r.text for r in reqs] == ["rngd:1", "cuda:auto"]
    with pytest.raises(Exception):
        reqs[0].index = 5  # frozen dataclass


def test_parse_omegaconf_listconfig():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"backend": ["furiosa:0", "furiosa:auto"]})
    reqs = parse_backend_list(cfg.backend)
    assert [(r.kind, r.index) for r in reqs] == [("furiosa", 0), ("furiosa", None)]


@pytest.mark.parametrize(
    "value, must_contain",
    [
        ("furiosa:x", ["backend entry 'furiosa:x' is malformed", VALID_HINT]),
        ("tpu:0", ["unknown device kind 'tpu' in backend entry 'tpu:0'", VALID_HINT]),
        ("", ["backend list is empty", VALID_HINT]),
        ("  ", ["backend list is empty"]),
        ([], ["backend list is empty"]),
        (None, ["backend list is empty"]),
        ("cuda:-1", ["backend entry 'cuda:-1' is malformed", "start at 0"]),
        ("cuda:", ["backend entry 'cuda:' is malformed"]),
        ("cuda:1.0", ["backend entry 'cuda:1.0' is malformed"]),
        ("furiosa:0,furiosa:0", ["'furiosa:0' (#2) names furiosa:0, already named by entry 'furiosa:0' (#1)"]),
        (["furiosa:1", "rngd:1"], ["'rngd:1' (#2) names furiosa:1", "'furiosa:1' (#1)"]),
        ("cuda:0,cuda:0", ["names cuda:0, already named"]),
        ("cpu,,cpu", ["backend entry #2 is empty"]),
        ("cpu:0", ["backend entry 'cpu:0' is malformed", "cpu takes no index"]),
        ("gpu:0", ["unknown device kind 'gpu'", "cuda:N"]),
        ("furiosa 0", ["backend entry 'furiosa 0' is malformed"]),
        ([0], ["backend entry 0 is not a string"]),
        (5, ["must be a list of strings"]),
    ],
)
def test_parse_invalid(value, must_contain):
    with pytest.raises(BackendSpecError) as ei:
        parse_backend_list(value)
    for s in must_contain:
        assert s in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_auto_entries_do_not_count_as_duplicates():
    reqs = parse_backend_list("furiosa:auto,furiosa:auto,cuda,cuda")
    assert [r.index for r in reqs] == [None] * 4


# ============================================================================ resolve_cards
def _kinds_indices(reqs):
    return [(r.kind, r.index) for r in reqs]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("furiosa:auto,furiosa:auto", [("furiosa", 0), ("furiosa", 1)]),
        ("furiosa:1,furiosa:auto,furiosa:auto", [("furiosa", 1), ("furiosa", 0), ("furiosa", 2)]),
        ("furiosa:auto,furiosa:0", [("furiosa", 1), ("furiosa", 0)]),
        ("cuda,furiosa,cuda:auto,rngd", [("cuda", 0), ("furiosa", 0), ("cuda", 1), ("furiosa", 1)]),
        ("cpu,cpu", [("cpu", None), ("cpu", None)]),
        ("cuda:5,cuda:auto", [("cuda", 5), ("cuda", 0)]),
    ],
)
def test_resolve_without_probe_numbers_auto_entries(value, expected):
    out = resolve_cards(parse_backend_list(value), probe=False)
    assert _kinds_indices(out) == expected
    assert [r.text for r in out] == [e.strip() for e in value.split(",")]


def test_resolve_rejects_bad_requests_built_by_hand():
    with pytest.raises(BackendSpecError, match="empty"):
        resolve_cards([], probe=False)
    with pytest.raises(BackendSpecError, match="unknown device kind 'tpu'"):
        resolve_cards([Card("tpu", 0, text="tpu:0")], probe=False)
    with pytest.raises(BackendSpecError, match="twice"):
        resolve_cards([Card("cuda", 0, text="cuda:0"), Card("cuda", 0, text="cuda:0")], probe=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine has CUDA")
def test_resolve_probe_cuda_on_cpu_machine_names_the_entry():
    with pytest.raises((BackendUnavailableError, BackendSpecError)) as ei:
        resolve_cards(parse_backend_list("cpu,cuda:0"), probe=True)
    msg = str(ei.value)
    assert "backend entry 'cuda:0'" in msg
    assert "names a device that does not exist: this machine has 0 CUDA devices" in msg
    assert isinstance(ei.value, BackendUnavailableError)


def test_resolve_probe_cuda_counts(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _kinds_indices(resolve_cards(parse_backend_list("cuda:auto,cuda"), probe=True)) == [("cuda", 0), ("cuda", 1)]
    with pytest.raises(BackendSpecError) as ei:
        resolve_cards(parse_backend_list("cuda:3"), probe=True)
    assert str(ei.value).startswith("backend entry 'cuda:3' names a device that does not exist: "
                                    "this machine has 2 CUDA devices")
    with pytest.raises(BackendSpecError, match="'cuda:auto' cannot be placed: this machine has 2 CUDA devices"):
        resolve_cards(parse_backend_list("cuda:auto,cuda:auto,cuda:auto"), probe=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(BackendUnavailableError, match="this machine has 0 CUDA devices"):
        resolve_cards(parse_backend_list("cuda:0"), probe=True)


def test_resolve_probe_cpu_only_touches_nothing():
    assert _kinds_indices(resolve_cards(parse_backend_list("cpu"), probe=True)) == [("cpu", None)]


def test_resolve_probe_furiosa_without_runtime():
    # the main venv has no furiosa-torch, and this machine no RNGD runtime
    if fur.runtime_problem() is None:
        pytest.skip("this machine has an RNGD runtime")
    with pytest.raises(BackendUnavailableError) as ei:
        resolve_cards(parse_backend_list("furiosa:0"), probe=True)
    assert "backend entry 'furiosa:0'" in str(ei.value)


def test_resolve_probe_furiosa_counts_device_nodes(monkeypatch, tmp_path):
    rngd = tmp_path / "rngd"
    rngd.mkdir()
    for n in ("npu0mgmt", "npu0pe0", "npu0pe1-2", "npu1mgmt", "npu1pe0"):
        (rngd / n).touch()
    monkeypatch.setattr(fur, "furiosa_torch_importable", lambda: True)
    monkeypatch.setattr(fur, "find_runtime_library", lambda: "/opt/furiosa/lib/librenegade.so")
    real_list = fur.list_rngd_cards
    monkeypatch.setattr(fur, "list_rngd_cards", lambda dev_root="/dev": real_list(str(tmp_path)))
    monkeypatch.setattr(fur, "runtime_problem", lambda dev_root="/dev": None)
    out = resolve_cards(parse_backend_list("furiosa:auto,rngd:auto"), probe=True)
    assert _kinds_indices(out) == [("furiosa", 0), ("furiosa", 1)]
    with pytest.raises(BackendSpecError, match="'furiosa:2' names a device that does not exist: this machine has 2 RNGD devices"):
        resolve_cards(parse_backend_list("furiosa:2"), probe=True)


# ============================================================================ RNGD runtime probes
def test_list_rngd_cards(tmp_path):
    assert fur.list_rngd_cards(str(tmp_path)) == []
    (tmp_path / "rngd").mkdir()
    for n in ("npu3mgmt", "npu0mgmt", "npu0pe0", "npu3pe4-7"):
        (tmp_path / "rngd" / n).touch()
    assert fur.list_rngd_cards(str(tmp_path)) == [0, 3]


def test_list_rngd_cards_without_mgmt_nodes(tmp_path):
    (tmp_path / "rngd").mkdir()
    (tmp_path / "rngd" / "npu1pe0").touch()
    (tmp_path / "rngd2").touch()
    assert fur.list_rngd_cards(str(tmp_path)) == [1, 2]


def test_runtime_problem_messages(monkeypatch, tmp_path):
    monkeypatch.setattr(fur, "furiosa_torch_importable", lambda: False)
    assert "furiosa-torch is not installed" in fur.runtime_problem(str(tmp_path))
    assert "setup_furiosa_env.sh" in fur.runtime_problem(str(tmp_path))
    monkeypatch.setattr(fur, "furiosa_torch_importable", lambda: True)
    monkeypatch.setattr(fur, "find_runtime_library", lambda: None)
    msg = fur.runtime_problem(str(tmp_path))
    assert msg.startswith("no RNGD device/runtime: librenegade.so not found")
    assert "install the Furiosa runtime / check /dev/rngd*" in msg
    monkeypatch.setattr(fur, "find_runtime_library", lambda: "librenegade.so")
    msg = fur.runtime_problem(str(tmp_path))
    assert msg.startswith("no RNGD device/runtime: no RNGD device nodes")
    (tmp_path / "rngd").mkdir()
    (tmp_path / "rngd" / "npu0mgmt").touch()
    assert fur.runtime_problem(str(tmp_path)) is None


def test_find_runtime_library_absent_here():
    # No Furiosa runtime is installed on the development machines; this documents the probe.
    if fur.find_runtime_library() is not None:
        pytest.skip("librenegade.so is installed here")
    assert fur.find_runtime_library() is None


# ============================================================================ cpu backend
def test_cpu_backend_basics():
    b = make_backend(Card("cpu", None, text="cpu"))
    assert isinstance(b, CPUBackend)
    assert (b.kind, b.index, b.name) == ("cpu", None, "cpu")
    b.setup()
    b.setup()  # idempotent
    assert b.device() == torch.device("cpu")
    assert b.capacity_bytes() == psutil.virtual_memory().total
    assert b.memory_flag_thread_local is True
    assert isinstance(b.alloc_lock(), contextlib.nullcontext)


def test_cpu_upload_download_never_alias():
    b = make_backend("cpu")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    u = b.upload(t)
    assert u.device.type == "cpu" and torch.equal(u, t)
    assert u.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    t.add_(1)  # the host buffer is reused: the uploaded copy must not change
    assert torch.equal(u, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    d = b.download(u)
    assert torch.equal(d, u) and d.untyped_storage().data_ptr() != u.untyped_storage().data_ptr()
    assert b.upload(t, non_blocking=True).dtype == torch.float32


def test_cpu_memory_is_anon_shared_rss_with_sampled_peak():
    b = make_backend("cpu")
    b.reset_peak_memory()
    full = psutil.Process().memory_full_info()
    alloc = b.memory_allocated()
    # RssAnon + RssShmem: the RSS less its file pages (psutil's "shared" counts file + shmem pages)
    assert 0 < alloc <= full.rss and abs(alloc - (full.rss - full.shared)) < 64 * 2**20
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    up = b.upload(big)  # samples RSS after the copy
    peak = b.max_memory_allocated()
    assert peak >= b.memory_allocated() - 32 * 2**20
    assert peak >= alloc + 32 * 2**20
    del big, up
    b.reset_peak_memory()
    assert b.max_memory_allocated() <= peak
    b.synchronize()


def test_cpu_backend_pickles_and_sets_up_again():
    b = make_backend("cpu")
    b.setup()
    b2 = pickle.loads(pickle.dumps(b))
    assert not b2.is_setup
    assert torch.equal(b2.upload(torch.ones(2)), torch.ones(2))
    assert b2.is_setup


# ============================================================================ make_backend / cuda
def test_make_backend_dispatch_without_touching_devices():
    assert FURIOSA_PREIMPORTED or sys.modules.get("furiosa.torch") is None
    cb = make_backend(Card("cuda", 1, text="cuda:1"))
    assert isinstance(cb, CUDABackend) and cb.name == "cuda:1" and cb.device() == torch.device("cuda", 1)
    fb = make_backend(Card("furiosa", 1, text="rngd:1"))
    assert isinstance(fb, FuriosaBackend) and fb.name == "furiosa:1"
    assert fb.capacity_bytes() == FURIOSA_CAPACITY_BYTES == int(47.5 * 2**30)
    assert FURIOSA_PREIMPORTED or sys.modules.get("furiosa.torch") is None  # only setup() imports it


def test_make_backend_rejects_unresolved_auto():
    with pytest.raises(BackendSpecError, match="resolve_cards"):
        make_backend(Card("furiosa", None, text="furiosa:auto"))
    with pytest.raises(BackendSpecError, match="unknown device kind"):
        make_backend(Card("tpu", 0, text="tpu:0"))
    with pytest.raises(BackendSpecError):
        make_backend("cpu,cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine has CUDA")
def test_cuda_setup_on_cpu_machine_is_unavailable():
    b = make_backend(Card("cuda", 0, text="cuda:0"))
    with pytest.raises(BackendUnavailableError, match="cuda:0: CUDA is not available"):
        b.setup()


# ============================================================================ AllocLock
def test_alloc_lock_is_reentrant_and_reports_locked():
    lock = AllocLock()
    assert not lock.locked()
    with lock:
        assert lock.locked()
        with lock:  # re-entry from the same thread (upload inside `with alloc_lock()`)
            assert lock.locked()
        seen = []
        th = threading.Thread(target=lambda: seen.append((lock.locked(), lock.acquire(blocking=False))))
        th.start()
        th.join()
        assert seen == [(True, False)]
    assert not lock.locked()


# ============================================================================ fake furiosa-torch
class _MemoryType(enum.Enum):
    """Mirror of furiosa.torch._C.memory.MemoryType (Dram, DramShared, Cpu)."""

    Dram = 0
    DramShared = 1
    Cpu = 2


class _Fusion:
    def __init__(self, n):
        self.num_fusion = n

    def __repr__(self):
        return f"Fusion(num_fusion={self.num_fusion})"


class _Stream:
    def __init__(self, log, sid):
        self.log, self.stream_id = log, sid

    def synchronize(self):
        self.log.append(("sync", self.stream_id))


class FakeFuriosa:
    """Builds fake ``furiosa``, ``furiosa.torch``, ``furiosa.torch._C``, ``furiosa.torch._C.memory``."""

    def __init__(self, *, thread_local: bool = True, n_devices: int = 8):
        self.calls: list = []
        self.fusion = None
        self.mesh = None
        self.thread_local = thread_local
        self._tls = threading.local()
        self._global = _MemoryType.Dram
        self.n_devices = n_devices

        furiosa = types.ModuleType("furiosa")
        furiosa.__path__ = []
        ft = types.ModuleType("furiosa.torch")
        ft.__path__ = []
        c = types.ModuleType("furiosa.torch._C")
        c.__path__ = []
        mem = types.ModuleType("furiosa.torch._C.memory")
        mem.MemoryType = _MemoryType
        mem._get_memory_type = self._get_memory_type
        mem._set_memory_type = self._set_memory_type
        c.memory = mem
        ft._C = c
        furiosa.torch = ft

        class MeshKind:
            class Single:
                def __repr__(self):
                    return "Single"

            class Mesh:
                def __init__(self, k):
                    self.k = k

        ft.MeshKind = MeshKind
        ft.MemoryType = _MemoryType
        ft.Fusion = _Fusion
        ft.set_fusion = self.set_fusion
        ft.get_fusion = self.get_fusion
        ft.set_mesh_kind = self.set_mesh_kind
        ft.get_mesh_kind = lambda: self.mesh
        ft.get_available_devices = lambda: [f"furiosa:{i}" for i in range(self.n_devices)]
        ft.exchange_device = self.exchange_device
        ft.current_device = lambda: torch.device(PU1, 0)
        ft.is_available = lambda device=None: device is None
        ft.current_stream = lambda dev: _Stream(self.calls, 0)
        ft.default_stream = lambda dev: _Stream(self.calls, 0)
        ft.version = lambda: "furiosa-torch 2026.4.0 (fake)"
        # furiosa.torch.config (config/__init__.py, _cache.py, _cpu_fallback.py, _C/config/cache)
        cfg = types.ModuleType("furiosa.torch.config")
        self.settings = {"root_dir": "/home/u/.cache/furiosa", "num_load": 32, "cpu_fallback": True}

        def set_cache_config(cache_config=None, root_dir=None, summary=None, ensure=None,
                             failure_link_dir=None):
            prev = types.SimpleNamespace(root_dir=self.settings["root_dir"])
            self.settings["root_dir"] = root_dir
            return prev

        def set_cpu_fallback(v):
            prev, self.settings["cpu_fallback"] = self.settings["cpu_fallback"], bool(v)
            return prev

        cfg.set_cache_config = set_cache_config
        cfg.get_cache_config = lambda: types.SimpleNamespace(root_dir=self.settings["root_dir"])
        cfg.set_eager_cache_size = lambda num_exported_program=8192, num_compiled=8192, num_load=2048: \
            self.settings.update(num_load=num_load)
        cfg.set_cpu_fallback = set_cpu_fallback
        cfg.get_cpu_fallback = lambda: self.settings["cpu_fallback"]
        ft.config = cfg
        self.modules = {"furiosa": furiosa, "furiosa.torch": ft, "furiosa.torch._C": c,
                        "furiosa.torch._C.memory": mem, "furiosa.torch.config": cfg}
        self.ft, self.mem = ft, mem

    # real behaviour: only one set_fusion per process; get_fusion() first fixes fusion at 1
    def set_fusion(self, n):
        self.calls.append(("set_fusion", n))
        if self.fusion is not None and self.fusion.num_fusion != n:
            raise RuntimeError(f"num_fusion is already set, Fusion {{ num_fusion: {self.fusion.num_fusion} }}")
        self.fusion = _Fusion(n)
        self.n_devices = 64 // n
        return self.fusion

    def get_fusion(self):
        if self.fusion is None:
            self.fusion = _Fusion(1)
        return self.fusion

    def set_mesh_kind(self, kind):
        self.calls.append(("set_mesh_kind", type(kind).__name__))
        self.mesh = kind
        return kind

    def exchange_device(self, dev):
        self.calls.append(("exchange_device", str(dev)))
        return torch.device(PU1, 0)

    def _get_memory_type(self):
        if self.thread_local:
            return getattr(self._tls, "v", _MemoryType.Dram)
        return self._global

    def _set_memory_type(self, v):
        prev = self._get_memory_type()
        if self.thread_local:
            self._tls.v = v
        else:
            self._global = v
        return prev


@pytest.fixture
def fake_furiosa(monkeypatch):
    """Install a fake furiosa-torch (thread-local flag, like 2026.4) with a runtime 'present'."""
    fur._reset_process_state_for_tests()

    def install(*, thread_local=True, lib="/opt/furiosa/lib/librenegade.so", to_device=None):
        fake = FakeFuriosa(thread_local=thread_local)
        for name, mod in fake.modules.items():
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(fur, "find_runtime_library", lambda: lib)
        fake.uploads = []

        def default_to_device(t, device, non_blocking=False):
            fake.uploads.append(tuple(t.shape))
            return t.clone()  # the "device" tensor lives on the CPU in this fake

        monkeypatch.setattr(fur, "_to_device", to_device or default_to_device)
        monkeypatch.setattr(fur, "_to_host", lambda t: t.clone())
        return fake

    yield install
    acct.uninstall_all()  # the backends' dispatch-mode accounting of this thread
    for f in list(logging.getLogger(FURIOSA_LOGGER).filters):
        logging.getLogger(FURIOSA_LOGGER).removeFilter(f)
    fur._reset_process_state_for_tests()


def test_furiosa_setup_with_fake_module_thread_local(fake_furiosa):
    fake = fake_furiosa(thread_local=True)
    b = FuriosaBackend(2)
    assert b.memory_flag_thread_local is None
    b.setup()
    assert b.memory_flag_thread_local is True
    assert "thread-local" in b.memory_flag_probe_detail
    assert isinstance(b.alloc_lock(), contextlib.nullcontext)
    assert not b.needs_alloc_lock
    assert ("set_fusion", 8) in fake.calls and ("set_mesh_kind", "Single") in fake.calls
    assert ("exchange_device", f"{PU1}:2") in fake.calls  # main venv: PrivateUse1 is "privateuseone"
    assert b.device() == torch.device(PU1, 2)
    assert fake.uploads == [(1,)]  # the 1-element probe round trip
    assert fake.mem._get_memory_type() is _MemoryType.Dram  # flag restored
    b.synchronize()
    assert ("sync", 0) in fake.calls
    # a second backend in the same process does not set fusion again
    FuriosaBackend(3).setup()
    assert [c for c in fake.calls if c[0] == "set_fusion"] == [("set_fusion", 8)]


def test_furiosa_process_wide_flag_gives_real_lock(fake_furiosa):
    fake = fake_furiosa(thread_local=False)
    b = FuriosaBackend(0)
    b.setup()
    assert b.memory_flag_thread_local is False
    assert "PROCESS-WIDE" in b.memory_flag_probe_detail
    lock = b.alloc_lock()
    assert isinstance(lock, AllocLock) and lock is b.alloc_lock()
    assert fake.mem._get_memory_type() is _MemoryType.Dram  # probe restored the process-wide flag

    held = []

    def to_device(t, device, non_blocking=False):
        held.append(lock.locked())
        return t.clone()

    fur._to_device = to_device  # restored by monkeypatch in the fixture
    b.upload(torch.ones(3))
    assert held == [True]
    with b.alloc_lock():  # nested: upload takes the same (re-entrant) lock
        b.upload(torch.ones(2))
    assert not lock.locked()


def test_furiosa_alloc_lock_before_setup_is_conservative():
    b = FuriosaBackend(0)
    assert isinstance(b.alloc_lock(), AllocLock)


def test_furiosa_missing_runtime_library(fake_furiosa):
    fake = fake_furiosa(lib=None)
    b = FuriosaBackend(0)
    with pytest.raises(BackendUnavailableError) as ei:
        b.setup()
    msg = str(ei.value)
    assert msg.startswith("no RNGD device/runtime:")
    assert "librenegade.so not found" in msg
    assert "install the Furiosa runtime / check /dev/rngd*" in msg
    assert fake.uploads == []  # detected before any allocation
    assert not b.is_setup
    assert b.memory_flag_thread_local is True  # the flag probe needs no device


def test_furiosa_runtime_oom_on_probe_allocation_is_translated(fake_furiosa):
    def oom(t, device, non_blocking=False):
        raise torch.OutOfMemoryError(f"failed to allocate {t.numel() * t.element_size()} bytes")

    fake_furiosa(to_device=oom)
    b = FuriosaBackend(0)
    with pytest.raises(BackendUnavailableError) as ei:
        b.setup()
    msg = str(ei.value)
    assert msg.startswith("no RNGD device/runtime: furiosa:0:")
    assert "1-element probe allocation failed with OutOfMemoryError: failed to allocate 4 bytes" in msg
    assert "install the Furiosa runtime / check /dev/rngd*" in msg
    assert isinstance(ei.value.__cause__, torch.OutOfMemoryError)


def test_furiosa_upload_oom_after_setup(fake_furiosa, monkeypatch):
    fake_furiosa()
    b = FuriosaBackend(0)
    b.setup()

    def oom(t, device, non_blocking=False):
        raise torch.OutOfMemoryError("failed to allocate 4096 bytes")

    monkeypatch.setattr(fur, "_to_device", oom)
    # runtime present: a real OOM stays a real OOM
    with pytest.raises(torch.OutOfMemoryError):
        b.upload(torch.ones(1024))
    # runtime gone: translated
    monkeypatch.setattr(fur, "find_runtime_library", lambda: None)
    with pytest.raises(BackendUnavailableError, match="no RNGD device/runtime"):
        b.upload(torch.ones(1024))


def test_furiosa_not_importable(monkeypatch):
    fur._reset_process_state_for_tests()
    monkeypatch.setitem(sys.modules, "furiosa.torch", None)  # import raises ImportError
    with pytest.raises(BackendUnavailableError, match="furiosa-torch is not importable.*setup_furiosa_env.sh"):
        FuriosaBackend(0).setup()


def test_furiosa_fusion_already_fixed(fake_furiosa):
    fake = fake_furiosa()
    fake.ft.get_fusion()  # something touched the device context first: fusion is now 1
    with pytest.raises(BackendUnavailableError, match="cannot set furiosa-torch fusion to 8"):
        FuriosaBackend(0).setup()


def test_furiosa_fusion_env_override(fake_furiosa, monkeypatch):
    fake = fake_furiosa()
    monkeypatch.setenv(fur.FUSION_ENV, "4")
    b = FuriosaBackend(0)
    b.setup()
    assert b.num_fusion == 4 and ("set_fusion", 4) in fake.calls


def test_furiosa_index_out_of_range(fake_furiosa):
    fake_furiosa()
    with pytest.raises(BackendSpecError, match="'furiosa:8' names a device that does not exist"):
        FuriosaBackend(8).setup()  # fusion 8 -> 8 devices (0..7)


class CpuStandIn(FuriosaBackend):
    """The furiosa backend whose fake "device" tensors live on the CPU: its accounting counts
    CPU storages."""

    def _ledger_device_type(self) -> str:
        return "cpu"


def test_furiosa_tracked_memory(fake_furiosa):
    fake_furiosa()
    b = CpuStandIn(0, accounting="uploads")
    b.setup()
    base = b.memory_allocated()
    b.reset_peak_memory()
    x = b.upload(torch.ones(1024))  # 4 KiB
    y = b.upload(torch.ones(2048))  # 8 KiB
    assert b.memory_allocated() == base + 12288
    del y
    assert b.memory_allocated() == base + 4096
    assert b.max_memory_allocated() == base + 12288
    b.reset_peak_memory()
    assert b.max_memory_allocated() == base + 4096
    z = b.track(torch.empty(256))  # e.g. a parameter made on the device by to_empty()
    b.track(z)  # counted once
    assert b.memory_allocated() == base + 4096 + 1024
    del x, z
    assert b.memory_allocated() == base


def test_furiosa_backend_pickle_keeps_lock_need(fake_furiosa):
    fake_furiosa(thread_local=False)
    b = FuriosaBackend(1)
    b.setup()
    b2 = pickle.loads(pickle.dumps(b))
    assert b2.name == "furiosa:1" and not b2.is_setup
    assert isinstance(b2.alloc_lock(), AllocLock)
    assert b2.describe()["capacity_bytes"] == FURIOSA_CAPACITY_BYTES


# ============================================================================ flag probe, directly
def test_probe_thread_local_and_process_wide():
    assert fur.probe_memory_flag_scope(FakeFuriosa(thread_local=True).mem)[0] is True
    fake = FakeFuriosa(thread_local=False)
    fake._set_memory_type(_MemoryType.DramShared)  # baseline DramShared: probe flips to Dram
    thread_local, detail = fur.probe_memory_flag_scope(fake.mem)
    assert thread_local is False and "PROCESS-WIDE" in detail
    assert fake.mem._get_memory_type() is _MemoryType.DramShared


def test_probe_2026_2_style_int_api():
    """furiosa.native_torch.memory (2026.2): ints, _set_dram_shared_mode(), process-wide."""
    state = {"v": 0}
    mem = types.SimpleNamespace(
        _get_memory_type=lambda: state["v"],
        _set_memory_type=lambda v: state.__setitem__("v", v) or 0,
    )

    def set_dram_shared_mode():
        prev = state["v"]
        state["v"] = 1
        return prev

    mem._set_dram_shared_mode = set_dram_shared_mode
    thread_local, _ = fur.probe_memory_flag_scope(mem)
    assert thread_local is False and state["v"] == 0


def test_probe_inconclusive_means_process_wide():
    assert fur.probe_memory_flag_scope(None)[0] is False
    assert fur.probe_memory_flag_scope(types.SimpleNamespace())[0] is False

    def boom():
        raise RuntimeError("no context")

    assert fur.probe_memory_flag_scope(types.SimpleNamespace(_get_memory_type=boom, _set_memory_type=boom))[0] is False
    # a setter that does nothing: no visible effect even in the helper thread
    noop = types.SimpleNamespace(MemoryType=_MemoryType, _get_memory_type=lambda: _MemoryType.Dram,
                                 _set_memory_type=lambda v: _MemoryType.Dram)
    ok, detail = fur.probe_memory_flag_scope(noop)
    assert ok is False and "no visible effect" in detail


def test_memory_type_api_finds_fake_module(fake_furiosa):
    fake = fake_furiosa()
    assert fur.memory_type_api() is fake.mem


# ============================================================================ device accounting
def test_storage_ledger_counts_each_storage_once_until_freed():
    led = acct.StorageLedger("cpu")
    a = torch.ones(1000)                       # 4000 B
    led.add(a)
    led.add(a[10:])                            # a view: same storage
    led.add(a.mul_(2))                         # in place: same storage
    assert led.bytes == 4000 and len(led) == 1
    led.add(torch.ones(3, device="meta"))      # other device: ignored
    led.add("not a tensor")
    b = torch.ones(500, dtype=torch.float64)   # 4000 B
    led.add_all({"x": [b, (b.view(-1),)]})
    assert led.bytes == 8000 and led.peak == 8000
    v = a[:10]
    del a                                      # the view keeps the storage alive
    assert led.bytes == 8000
    del v
    assert led.bytes == 4000 and led.peak == 8000
    led.reset_peak()
    assert led.peak == 4000
    del b
    assert led.bytes == 0


def test_dispatch_mode_sees_factories_results_and_backward():
    led = acct.StorageLedger("cpu")
    w = torch.ones(64, 64, requires_grad=True)         # made before: not counted
    with acct.DeviceAllocationMode(led):
        z = torch.zeros(256)                           # factory: 1 KiB
        y = (w * 2).sum()                              # result of compute (+ 16 KiB temporary)
        y.backward()                                   # w.grad: 16 KiB, made by autograd
    assert led.bytes == 1024 + 4 + 64 * 64 * 4         # z, y and w.grad are alive
    del z, y
    w.grad = None
    assert led.bytes == 0 and led.peak >= 1024 + 4 + 64 * 64 * 4


def _tiny_stage_cfg():
    from npu_train.model.config import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=2,
                       num_heads=4, num_kv_heads=2, tie_word_embeddings=False, name="tiny")


def _run_stage_on(backend_factory, fake_furiosa):
    """A real stage (both ends, 2 layers, fp32, all parameters resident) for two optimizer steps of
    M=2 micro-batches on a CPU stand-in of the furiosa backend. Returns (backend, params, quiet
    bytes after step 2, peak bytes of step 2, saved-activation bytes of one micro-batch)."""
    from npu_train.model.llama import StageModule
    from npu_train.optim.adamw import StageOptimizer
    from npu_train.pipeline.stage import StageRunner

    fake_furiosa()
    cfg = _tiny_stage_cfg()
    torch.manual_seed(0)
    with torch.device("meta"):
        module = StageModule(cfg, 0, 2, True, True)
    masters = {n: torch.randn(p.shape) * 0.02 for n, p in module.named_parameters()}  # host, before setup
    xs = [torch.randint(0, 1024, (2, 64)) for _ in range(2)]
    ys = [torch.randint(0, 1024, (2, 64)) for _ in range(2)]
    b = backend_factory()
    b.setup()
    module = module.to_empty(device=b.device())
    for p in module.parameters():
        b.track(p)                                   # what build_stage does
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(b.upload(masters[n]))
    params = dict(module.named_parameters())
    opt = StageOptimizer(params, masters, list(params), b, lr=1e-3, weight_decay=0.1)
    runner = StageRunner(module, b, 1, 0, "1f1b", None)
    for step in range(2):
        b.reset_peak_memory()
        opt.zero_grad()
        runner.run_step(step, xs, ys)
        opt.grad_sq_sum()
        opt.step(1e-3, 1.0)
    quiet, peak = b.memory_allocated(), b.max_memory_allocated()
    # saved activations of one micro-batch, measured by autograd's own hooks (not the ledger)
    pstores = {p.untyped_storage()._cdata for p in params.values()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in pstores:
            saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        from npu_train.model.llama import causal_lm_loss_sum

        loss, _ = causal_lm_loss_sum(module(xs[0]), ys[0])
    del loss
    return b, params, quiet, peak, sum(saved.values())


def test_furiosa_accounting_sees_every_device_tensor_on_a_stand_in(fake_furiosa):
    """The issue's stand-in: 'tracked' memory counted only uploads and parameters (8 MiB of 56).
    With the dispatch accounting, after a step the card holds fp32 weights, masters and AdamW m and v:
    4 x 4 B/param (the optimizer step consumes the step's gradients); at the step's peak the gradients
    (4 B/param) and one micro-batch's saved activations are on top (1F1B with P = 1 holds one in flight).

    Mutation check: make ``DeviceAllocationMode.__torch_dispatch__`` skip ``ledger.add_all`` and
    the quiet figure drops to the weights (4 B/param): this test fails."""
    acct.uninstall_all()

    class StandIn(CpuStandIn):
        def device(self):
            return torch.device("cpu")

    b, params, quiet, peak, act = _run_stage_on(lambda: StandIn(0), fake_furiosa)
    n = sum(p.numel() for p in params.values())
    expect = 16 * n                                   # weights, master, exp_avg, exp_avg_sq
    assert abs(quiet - expect) / expect < 0.10, (quiet, expect)
    assert abs(peak - (expect + 4 * n + act)) / (expect + 4 * n + act) < 0.10, (peak, expect, act)
    assert b.describe()["memory_accounting"] == "dispatch"
    acct.uninstall_all()


def test_furiosa_uploads_accounting_misses_what_the_card_makes(fake_furiosa):
    """The old figure, kept behind ``accounting="uploads"``: uploads and tracked tensors only. The
    weights (4 B/param) and the AdamW moments, which the stage optimizer creates up front and tracks
    (``eager_state``: 8 B/param), are in it; the masters' on-card clone (4 B/param), the step's
    gradients and the saved activations are not (what issue 12 measured). The dispatch figure of the
    same stage is 16 B/param quiet and 20 B/param + activations at the peak."""
    acct.uninstall_all()

    class StandIn(CpuStandIn):
        def device(self):
            return torch.device("cpu")

    b, params, quiet, peak, act = _run_stage_on(lambda: StandIn(0, accounting="uploads"), fake_furiosa)
    n = sum(p.numel() for p in params.values())
    assert abs(quiet - 12 * n) / (12 * n) < 0.05, (quiet, 12 * n)   # weights + tracked moments
    assert peak < 12 * n + 0.5 * act, (peak, n, act)     # nor gradients or activations at the peak


def test_furiosa_setup_keeps_the_thread_count(fake_furiosa, monkeypatch):
    fake = fake_furiosa()
    before = torch.get_num_threads()

    def import_that_changes_threads():  # as if furiosa-torch's import set torch threads
        torch.set_num_threads(before + 3)
        return fake.ft

    monkeypatch.setattr(fur, "_import_furiosa_torch", import_that_changes_threads)
    b = FuriosaBackend(0)
    b.setup()
    assert torch.get_num_threads() == before
    assert b.threads_restored == (before + 3, before)


def test_furiosa_compile_options_applied_and_fallbacks_counted(fake_furiosa, tmp_path, monkeypatch):
    fake = fake_furiosa()
    monkeypatch.setattr(logging.getLogger(FURIOSA_LOGGER), "level", logging.INFO)  # as in a card process
    cache = tmp_path / "furiosa" / "compiler"
    b = FuriosaBackend(0, compile_options=FuriosaCompileOptions(
        compiler_cache_dir=str(cache), loaded_modules=300, cpu_fallback=False))
    b.setup()
    assert cache.is_dir()
    assert fake.settings == {"root_dir": str(cache), "num_load": 300, "cpu_fallback": False}
    assert b.describe()["compile"] == {"compiler_cache_dir": str(cache), "loaded_modules": 300,
                                       "cpu_fallback": False}
    lg = logging.getLogger(FURIOSA_LOGGER)
    got = []
    handler = logging.Handler()
    handler.emit = got.append
    lg.addHandler(handler)
    try:
        lg.debug("failed to compile & run aten::foo on Furiosa, fallback to CPU")   # eager.py
        lg.warning("aten::uniform_ fell back to CPU: unsupported dtype %s", "x",
                   extra={"furiosa_cpu_fallback": "aten::uniform_"})            # prng.py
        lg.debug("graph compiled successfully")                                    # not a fallback
    finally:
        lg.removeHandler(handler)
    assert [r.levelno for r in got] == [logging.WARNING]    # no new DEBUG output reaches handlers
    stats = b.step_stats()
    assert stats["cpu_fallbacks"] == 2
    assert b._fallbacks.by_op == {"aten::foo": 1, "aten::uniform_": 1}
    assert b.step_stats()["cpu_fallbacks"] == 0              # per step


def test_furiosa_default_turns_cpu_fallback_off(fake_furiosa):
    fake = fake_furiosa()
    assert fake.settings["cpu_fallback"] is True             # furiosa-torch's default
    FuriosaBackend(0).setup()
    assert fake.settings["cpu_fallback"] is False
    assert fake.settings["num_load"] == 32                   # not touched without a count


def test_loaded_module_stats_reads_the_lru_cache():
    import functools

    from npu_train.backends.furiosa_compile import loaded_module_stats

    cached = functools.lru_cache(maxsize=4)(lambda k: k)
    for k in (1, 2, 1, 3):
        cached(k)
    mod = types.SimpleNamespace(_compile_and_load_cached=cached)
    assert loaded_module_stats(mod) == {"loaded": 3, "capacity": 4, "misses": 3}
    assert loaded_module_stats(types.SimpleNamespace()) is None


def test_probe_free_bytes_fills_until_the_runtime_refuses():
    from npu_train.backends.furiosa_compile import probe_free_bytes

    free = 1000 * 2**20 + 40 * 2**20            # 1040 MiB free on a pretend card
    live = []

    def alloc(n):
        if sum(live) + n > free:
            raise torch.OutOfMemoryError(f"failed to allocate {n} bytes")
        live.append(n)
        return n

    assert probe_free_bytes(alloc, 47 * 2**30) == 3 * 256 * 2**20 + 17 * 16 * 2**20  # 16 MiB resolution
    assert probe_free_bytes(lambda n: n, 300 * 2**20) == 256 * 2**20 + 2 * 16 * 2**20  # stops at the limit


def test_furiosa_step_stats_with_probe_free(fake_furiosa, monkeypatch):
    fake_furiosa()
    b = CpuStandIn(0, accounting="uploads", compile_options=FuriosaCompileOptions(probe_free=True))
    monkeypatch.setattr(b, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(b, "capacity_bytes", lambda: 64 * 2**20)        # a 64 MiB "card"
    b.setup()
    x = b.upload(torch.ones(2**20))                                      # 4 MiB
    stats = b.step_stats()
    assert stats["card_free"] == 64 * 2**20 and stats["mem_quiet"] == 4 * 2**20
    assert b.max_memory_allocated() == 4 * 2**20                         # the probe is not a peak
    del x
