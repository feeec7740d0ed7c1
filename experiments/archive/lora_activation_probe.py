"""Anon RSS of stage 0 of SmolLM2-135M (19 layers + embedding) through the 1F1B order of stage 0 of 2,
random weights: ``python experiments/archive/lora_activation_probe.py lora|full`` (``STEPS=n``). Run it
with ``MALLOC_MMAP_THRESHOLD_=262144`` to see the fixed threshold (2026-12-03-lora-memory.md)."""
import os, sys, torch, gc
torch.set_num_threads(1)
from npu_train.model import embedded_model_path
from npu_train.model.weights import load_config
from npu_train.model.llama import StageModule
from npu_train.model.lora import apply_lora, LoraSpec
def rss():
    d = dict(l.split(":",1) for l in open("/proc/self/status"))
    return round((int(d["RssAnon"].split()[0])+int(d["RssShmem"].split()[0]))/2**20,3), round(int(d["VmHWM"].split()[0])/2**20,3)
def reset(): open("/proc/self/clear_refs","w").write("5")
cfg = load_config(embedded_model_path())
mode = sys.argv[1]
with torch.device("meta"):
    m = StageModule(cfg, 0, 18, True, False)
m = m.to_empty(device="cpu")
for p in m.parameters(): torch.nn.init.normal_(p, std=0.02)
if mode == "lora":
    import inspect; print(inspect.signature(LoraSpec))
    apply_lora(m, LoraSpec(r=8, alpha=16.0, dropout=0.0, targets=("q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj")), 0)
gc.collect()
print("built", rss())
x = torch.randint(0, 1000, (2, 128))
print("--- 1f1b order")
reset()
import collections
q = collections.deque()
for op in ["F","F","B","F","B","F","B","B"]*int(os.environ.get("STEPS","3")):
    if op == "F":
        o = m(x); q.append(o)
    else:
        o = q.popleft(); o.backward(torch.randn_like(o)); del o
    print(op, rss())
