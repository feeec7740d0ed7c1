"""Contract tests against the REAL furiosa-torch (2026.4.0, torch 2.10.0).

They pin down the facts npu_train/backends/furiosa.py relies on. They run only where
furiosa-torch is importable; elsewhere (the main .venv) each test is skipped (a marker: deselected with
``-m 'not contract'``, the module is not listed at all):

    bash scripts/setup_furiosa_env.sh && .venv-furiosa/bin/pytest -m contract tests/contract

Without an RNGD card they check the no-hardware behaviour (clear "no RNGD device/runtime" error);
with a card (``librenegade.so`` loadable and ``/dev/rngd/npu*mgmt`` present) they check a real
round trip instead. Device-touching checks run in fresh subprocesses: furiosa-torch's fusion and
device context can be set only once per process, like in a real card worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

try:
    _FOUND = importlib.util.find_spec("furiosa.torch") is not None
except (ImportError, ValueError):
    _FOUND = False
# a skip marker, not a module-level pytest.skip: that one ran at collection, so the fast suite's
# -m "not heavy and not contract" listed this deselected module as SKIPPED
pytestmark = [pytest.mark.contract, pytest.mark.skipif(
    not _FOUND, reason="furiosa-torch is not installed in this Python; run "
    "`bash scripts/setup_furiosa_env.sh && .venv-furiosa/bin/pytest -m contract tests/contract`")]

import torch  # noqa: E402

if _FOUND:
    import furiosa.torch as ft  # noqa: E402  (a broken install fails here, on purpose)

from npu_train.backends import (  # noqa: E402
    BackendUnavailableError,
    FURIOSA_CAPACITY_BYTES,
    make_backend,
    parse_backend_list,
    resolve_cards,
)
from npu_train.backends import furiosa as fur  # noqa: E402

HAVE_RNGD = _FOUND and fur.find_runtime_library() is not None and bool(fur.list_rngd_cards())
no_hw = pytest.mark.skipif(HAVE_RNGD, reason="an RNGD runtime and device are present")
hw_only = pytest.mark.skipif(_FOUND and not HAVE_RNGD, reason="needs an RNGD card (librenegade.so + /dev/rngd/npu*mgmt)")


def _run(code: str, timeout: float = 180) -> dict:
    """Run ``code`` in a fresh interpreter; it must print one JSON line last."""
    env = dict(os.environ)
    env.setdefault("FURIOSA_TORCH_LOG", "furiosa_torch=error")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


# ============================================================================ import / versions
def test_versions():
    assert torch.__version__.startswith("2.10.0"), torch.__version__
    assert "furiosa-torch 2026.4" in ft.version(), ft.version()


def test_device_name_registered_as_furiosa():
    assert torch._C._get_privateuse1_backend_name() == "furiosa"
    assert hasattr(torch, "furiosa")
    b = make_backend("furiosa:1")
    assert b.device() == torch.device("furiosa", 1) == torch.device("furiosa:1")
    assert b.capacity_bytes() == FURIOSA_CAPACITY_BYTES == int(47.5 * 2**30)


def test_real_api_surface_used_by_the_backend():
    from furiosa.torch._C import memory

    for name in ("set_fusion", "get_fusion", "set_mesh_kind", "get_mesh_kind", "get_available_devices",
                 "exchange_device", "current_device", "is_available", "current_stream", "default_stream",
                 "with_memory_type", "MemoryType", "Stream", "Event"):
        assert hasattr(ft, name), name
    assert callable(ft.MeshKind.Single)
    assert hasattr(ft.Stream, "synchronize")
    assert {"Dram", "DramShared", "Cpu"} <= set(dir(memory.MemoryType))
    assert callable(memory._get_memory_type) and callable(memory._set_memory_type)
    assert fur.memory_type_api(ft) is memory
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    # no allocator statistics in 2026.4 (why FuriosaBackend tracks bytes itself)
    assert not hasattr(ft, "memory_allocated")


# ============================================================================ device resolution
def test_resolve_cards_without_probe():
    out = resolve_cards(parse_backend_list("furiosa:auto,rngd:auto,furiosa:5"), probe=False)
    assert [(r.kind, r.index) for r in out] == [("furiosa", 0), ("furiosa", 1), ("furiosa", 5)]


@no_hw
def test_resolve_cards_probe_without_hardware():
    with pytest.raises(BackendUnavailableError) as ei:
        resolve_cards(parse_backend_list("furiosa:0"), probe=True)
    assert "backend entry 'furiosa:0': no RNGD device/runtime" in str(ei.value)


@hw_only
def test_resolve_cards_probe_with_hardware():
    cards = fur.list_rngd_cards()
    out = resolve_cards(parse_backend_list(["furiosa:auto"] * len(cards)), probe=True)
    assert sorted(r.index for r in out) == list(range(len(cards)))


# ============================================================================ memory-type flag
def test_memory_type_flag_probe_result():
    """2026.2 kept the DRAM/DRAM_SHARED flag process-wide; 2026.4 made it thread-local."""
    from furiosa.torch._C import memory

    before = memory._get_memory_type()
    thread_local, detail = fur.probe_memory_flag_scope(fur.memory_type_api(ft))
    print("memory-type flag probe:", detail)
    assert memory._get_memory_type() == before
    assert thread_local is True, detail
    # the public context manager changes it for this thread only
    with ft.with_memory_type(memory.MemoryType.DramShared):
        assert memory._get_memory_type() == memory.MemoryType.DramShared
    assert memory._get_memory_type() == before


def test_memory_type_flag_probe_in_fresh_process():
    r = _run("""
        import json, torch
        import furiosa.torch as ft
        from npu_train.backends import furiosa as fur
        tl, detail = fur.probe_memory_flag_scope(fur.memory_type_api(ft))
        print(json.dumps({"thread_local": tl, "detail": detail}))
    """)
    assert r["thread_local"] is True, r["detail"]


# ============================================================================ no hardware
@no_hw
def test_raw_runtime_reports_missing_runtime_as_oom():
    """The behaviour the backend translates: a missing librenegade.so surfaces as OutOfMemoryError."""
    r = _run("""
        import json, torch
        import furiosa.torch as ft
        ft.set_fusion(8)
        try:
            torch.ones(1).to("furiosa:0")
            out = {"raised": None}
        except BaseException as e:
            out = {"raised": type(e).__name__, "oom": isinstance(e, torch.OutOfMemoryError), "msg": str(e)}
        out["is_available"] = ft.is_available("furiosa:0")
        out["n_devices"] = len(ft.get_available_devices())
        print(json.dumps(out))
    """)
    assert r["raised"] == "OutOfMemoryError" and r["oom"], r
    assert "failed to allocate" in r["msg"]
    assert r["is_available"] is False
    assert r["n_devices"] == 8  # listed even without hardware: not a device count


@no_hw
def test_backend_setup_without_hardware_is_clear():
    r = _run("""
        import json
        from npu_train.backends import make_backend, BackendUnavailableError
        b = make_backend("furiosa:0")
        try:
            b.setup()
            out = {"raised": None}
        except BackendUnavailableError as e:
            out = {"raised": "BackendUnavailableError", "msg": str(e)}
        out["thread_local"] = b.memory_flag_thread_local
        print(json.dumps(out))
    """)
    assert r["raised"] == "BackendUnavailableError", r
    assert r["msg"].startswith("no RNGD device/runtime:")
    assert "librenegade.so not found" in r["msg"]
    assert "install the Furiosa runtime / check /dev/rngd*" in r["msg"]
    assert r["thread_local"] is True


@no_hw
def test_backend_translates_the_real_runtime_oom():
    """Pretend the library is there, so the real 1-element probe allocation runs and fails."""
    r = _run("""
        import json, torch
        from npu_train.backends import make_backend, BackendUnavailableError
        from npu_train.backends import furiosa as fur
        fur.find_runtime_library = lambda: "/pretend/librenegade.so"
        b = make_backend("furiosa:0")
        try:
            b.setup()
            out = {"raised": None}
        except BackendUnavailableError as e:
            out = {"raised": "BackendUnavailableError", "msg": str(e),
                   "cause_oom": isinstance(e.__cause__, torch.OutOfMemoryError)}
        print(json.dumps(out))
    """)
    assert r["raised"] == "BackendUnavailableError", r
    assert r["msg"].startswith("no RNGD device/runtime: furiosa:0:")
    assert "failed to allocate" in r["msg"] and r["cause_oom"]


# ============================================================================ hardware
@hw_only
def test_backend_round_trip_on_hardware():
    r = _run("""
        import json, threading, torch
        from npu_train.backends import make_backend
        b = make_backend("furiosa:0")
        b.setup()
        x = torch.arange(1024, dtype=torch.float32)
        d = b.upload(x)
        b.synchronize()
        back = b.download(d)
        # uploads from two threads at once (what the flag bug broke on 2026.2)
        outs = []
        def up():
            outs.append(b.download(b.upload(torch.full((4096,), 7.0))))
        ts = [threading.Thread(target=up) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(json.dumps({"ok": torch.equal(back, x), "dev": str(d.device),
                          "threads_ok": all(float(o.sum()) == 7.0 * 4096 for o in outs) and len(outs) == 4,
                          "thread_local": b.memory_flag_thread_local, "alloc": b.memory_allocated()}))
    """, timeout=600)
    assert r["ok"] and r["dev"] == "furiosa:0", r
    assert r["threads_ok"], r
    assert r["thread_local"] is True
    assert r["alloc"] >= 4096


# ============================================================================ compiled execution, accounting
def test_compile_options_against_the_real_config_api(tmp_path):
    """``furiosa_compile.apply_compile_options`` on the real ``furiosa.torch.config`` (no device
    needed): cache directory, loaded-module cache size, CPU fallback off, fallback counter."""
    r = _run(f"""
        import json, logging
        import furiosa.torch as ft
        from furiosa.torch._backend import aten
        from npu_train.backends.furiosa_compile import (FuriosaCompileOptions, apply_compile_options,
                                                        loaded_module_stats)
        before = {{"fallback": ft.config.get_cpu_fallback(), "load": aten._compile_and_load_cached.cache_info().maxsize,
                   "env_load": ft.config.env.eager_num_load()}}
        done, counter = apply_compile_options(ft, FuriosaCompileOptions({str(tmp_path / 'cc')!r}, 300, False))
        logging.getLogger("furiosa_torch").warning("x fell back to CPU", extra={{"furiosa_cpu_fallback": "aten::x"}})
        print(json.dumps({{"before": before, "done": done, "fallbacks": counter.since_last(),
                          "root": ft.config.get_cache_config().root_dir, "stats": loaded_module_stats()}}))
    """)
    assert r["before"]["fallback"] is True            # furiosa-torch's default: on
    assert r["before"]["load"] == 32                  # lru_cache(maxsize=32) until set_eager_cache_size
    assert r["before"]["env_load"] == 2048            # set_eager_cache_size's default num_load
    assert r["done"]["cpu_fallback"] is False and r["done"]["loaded_modules"] == 300
    assert r["root"] == str(tmp_path / "cc") and (tmp_path / "cc").is_dir()
    assert r["stats"]["capacity"] == 300 and r["fallbacks"] == 1


def test_storage_objects_are_preserved_on_this_torch():
    """``accounting.StorageLedger`` relies on a ``weakref.finalize`` on ``untyped_storage()``
    firing when the storage dies, not when the Python wrapper does (torch 2.10 here)."""
    import gc
    import weakref

    fired = []
    t = torch.ones(100)
    weakref.finalize(t.untyped_storage(), fired.append, 1)
    gc.collect()
    assert fired == []
    v = t[1:]
    del t
    gc.collect()
    assert fired == []
    del v
    gc.collect()
    assert fired == [1]


@hw_only
def test_dispatch_accounting_sees_device_made_tensors_on_hardware():
    r = _run("""
        import json, torch
        from npu_train.backends import make_backend
        b = make_backend("furiosa:0")
        b.setup()
        base = b.memory_allocated()
        w = b.upload(torch.randn(256, 256)).requires_grad_(True)    # 256 KiB
        c = w.detach().clone()                                    # made on the card: 256 KiB
        z = torch.zeros_like(c)                                   # 256 KiB
        (w @ w).sum().backward()                                  # w.grad: 256 KiB, by autograd
        b.synchronize()
        print(json.dumps({"delta": b.memory_allocated() - base, "peak": b.max_memory_allocated() - base}))
    """, timeout=900)
    assert r["delta"] >= 4 * 256 * 256 * 4, r


@pytest.mark.xfail(strict=False, reason=(
    "furiosa-torch 2026.4 cannot decompose the attention output's `o.transpose(1, 2).reshape(B, S, "
    "heads*D)` of model/llama.py ('Cannot view a tensor with shape [1, 32, 4, 16] and strides "
    "(2048, 16, 512, 1) as (1, 32, 64)'); with `torch.einsum('bnsd->bsnd', o).clone(memory_format="
    "torch.contiguous_format).reshape(...)` the DFG imports, and differentiate + compile did not "
    "finish within 600 s on a 2-core machine (2026-11-30)"))
def test_whole_layer_graphs_build_without_a_card():
    """``runtime.furiosa.compiled_layers``: export a small decoder layer with its weights as
    inputs, import the DFG and let furiosa-torch's autograd builder differentiate and compile it
    (``furiosa_layer.install_compiled_layers`` does exactly this at the first call)."""
    r = _run("""
        import json, torch
        import furiosa.torch as ft
        from furiosa.torch._backend._autograd import build_autograd_from_module
        from npu_train.backends.furiosa_layer import layer_function
        from npu_train.model.config import LlamaConfig
        from npu_train.model.llama import StageModule, rope_cos_sin
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=4, num_kv_heads=2, tie_word_embeddings=False, name="tiny")
        m = StageModule(cfg, 0, 1, False, False).to(torch.bfloat16)
        layer = m.model.layers["0"]
        fn, names = layer_function(layer)
        cos, sin = rope_cos_sin(cfg, 32, "cpu", torch.bfloat16)
        args = (torch.zeros(1, 32, 64, dtype=torch.bfloat16), cos, sin,
                *[torch.zeros(p.shape, dtype=p.dtype) for _, p in layer.named_parameters()])
        out = {"names": len(names)}
        try:
            dfg = ft.DfgModule.from_module(fn, args)
            out["dfg"] = True
            Fn = build_autograd_from_module(dfg, name="npu_train_decoder_layer")
            out["function"] = issubclass(Fn, torch.autograd.Function)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        print(json.dumps(out))
    """, timeout=1800)
    print(r)
    assert r["names"] == 9
    assert r.get("dfg"), r
    assert r.get("function"), r
