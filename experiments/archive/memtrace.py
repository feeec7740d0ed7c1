"""Memory tracer used for experiments/2026-12-01-offload-memory.md (investigation aid, not part of npu-train).

A card process calls ``start(trainer, rank)`` after ``StageTrainer.setup()``; the hook used (two lines in
``runtime/worker.py::worker_main``, not committed)::

    if os.environ.get("NPT_MEMTRACE"):
        sys.path.insert(0, "experiments/scripts"); import memtrace; memtrace.start(trainer, rank)

It counts live tensor storages >= 4 KiB (tagged thread:phase:op) with a dispatch mode in the main and
the host-update thread, samples /proc/self/statm RSS every 3 ms, and writes
``$NPT_MEMTRACE.rank<r>.json`` at ``trainer.close()``. Uses HostUpdater internals (``_pool``, ``_fetch``,
``_layer_task``): for investigation only.
"""
import gc, json, os, threading, time, weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

class TagLedger:
    def __init__(self):
        self.live = {}; self.lock = threading.Lock(); self.bytes = 0; self.peak = 0
        self.tags = {}; self.peak_tags = {}
    def add(self, t, tag):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        try:
            st = t.untyped_storage()
        except Exception:
            return
        key = st._cdata
        with self.lock:
            if key in self.live:
                return
            n = int(st.nbytes())
            if n < 4096:
                return
            self.live[key] = (n, tag)
            self.bytes += n
            self.tags[tag] = self.tags.get(tag, 0) + n
            if self.bytes > self.peak:
                self.peak = self.bytes
                self.peak_tags = dict(self.tags)
                self.peak_phase = PHASE[0]
        weakref.finalize(st, self.drop, key)
    def drop(self, key):
        with self.lock:
            n, tag = self.live.pop(key, (0, None))
            if tag is not None:
                self.bytes -= n
                self.tags[tag] -= n

PHASE = ["?"]

class Mode(TorchDispatchMode):
    def __init__(self, led, th):
        super().__init__(); self.led = led; self.th = th
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tag = f"{self.th}:{PHASE[0].split(' ', 2)[-1]}:{func.__name__}"
        for t in tree_leaves(out):
            self.led.add(t, tag)
        return out

def start(trainer, rank):
    led = TagLedger()
    PHASE[0] = "pre"
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                led.add(o, "pre")
        except Exception:
            pass
    main_phase = trainer.phase
    m = Mode(led, "main"); m.__enter__()
    host = trainer.opt.host
    if host._pool is not None:
        def inst():
            Mode(led, "host").__enter__()
        host._pool.submit(inst).result()
    samples = []; events = []
    stop = threading.Event()
    t0 = time.perf_counter()
    def sampler():
        f = open("/proc/self/statm")
        pg = os.sysconf("SC_PAGE_SIZE")
        while not stop.is_set():
            PHASE[0] = main_phase[0]
            f.seek(0); rss = int(f.read().split()[1]) * pg
            samples.append((round(time.perf_counter() - t0, 4), rss, led.bytes, main_phase[0]))
            time.sleep(0.003)
    th = threading.Thread(target=sampler, daemon=True); th.start()
    for nm in ("_fetch", "_layer_task"):
        orig = getattr(host, nm)
        def wrap(*a, orig=orig, nm=nm):
            events.append((round(time.perf_counter() - t0, 4), nm + ">", str(a[0])[:30] if nm == "_layer_task" else ""))
            r = orig(*a)
            events.append((round(time.perf_counter() - t0, 4), nm + "<", ""))
            return r
        setattr(host, nm, wrap)
    orig_close = trainer.close
    def close():
        stop.set(); th.join()
        peak = max(samples, key=lambda s: s[1])
        out = {"rank": rank, "ledger_peak": led.peak, "ledger_peak_phase": getattr(led, "peak_phase", None),
               "ledger_peak_tags": sorted(((v, k) for k, v in led.peak_tags.items() if v), reverse=True),
               "rss_peak_sample": peak, "samples": samples, "events": events}
        with open(os.environ["NPT_MEMTRACE"] + f".rank{rank}.json", "w") as fh:
            json.dump(out, fh)
        return orig_close()
    trainer.close = close
