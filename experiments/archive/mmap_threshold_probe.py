"""Time and anon RSS of 4 full fine-tuning steps of stage 0 (15 layers + embedding, SmolLM2-135M shape)
with glibc's default mmap threshold or ``MMAP_T=<bytes>`` (2026-12-03-lora-memory.md)."""
import os, sys, time, torch, collections
torch.set_num_threads(1)
from npu_train.model import embedded_model_path
from npu_train.model.weights import load_config
from npu_train.model.llama import StageModule
import ctypes
if os.environ.get("MMAP_T"):
    libc = ctypes.CDLL("libc.so.6"); M_MMAP_THRESHOLD = -3
    print("mallopt", libc.mallopt(M_MMAP_THRESHOLD, int(os.environ["MMAP_T"])))
def rss():
    d = dict(l.split(":",1) for l in open("/proc/self/status"))
    return round((int(d["RssAnon"].split()[0]))/2**20,3), round(int(d["VmHWM"].split()[0])/2**20,3)
cfg = load_config(embedded_model_path())
with torch.device("meta"):
    m = StageModule(cfg, 0, 14, True, False)
m = m.to_empty(device="cpu")
for p in m.parameters(): torch.nn.init.normal_(p, std=0.02)
x = torch.randint(0, 1000, (2, 128))
open("/proc/self/clear_refs","w").write("5")
t0 = time.perf_counter()
for step in range(4):
    q = collections.deque()
    for op in ["F","F","B","F","B","F","B","B"]:
        if op == "F":
            q.append(m(x))
        else:
            o = q.popleft(); o.backward(torch.randn_like(o)); del o
    if step == 0: t1 = time.perf_counter()
print(os.environ.get("MMAP_T"), "steps 2-4 s", round(time.perf_counter()-t1, 2), "rss", rss())
