"""The optimizer-step hooks (:mod:`npu_train.optim.hooks`): when each hook fires, and that the optimizer,
the offload overlap and the pipeline runner go through them.

Expected orders come from the hooks' definitions: gradient ready once per parameter and micro-batch
after that micro-batch's gradient was added (``.grad`` = sum of the micro-batches so far), in
registration order; layer ready before the layer's forward; first forward sent once per step on
the first stage, after F0 and before any backward.
"""
from __future__ import annotations

import torch

from npu_train.backends.cpu import CPUBackend
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule
from npu_train.optim.adamw import StageOptimizer
from npu_train.optim.hooks import StepHooks
from npu_train.pipeline.stage import StageRunner
from npu_train.runtime.overlap import install_waits, layer_groups, layer_modules

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  max_position_embeddings=32)


def test_grad_ready_fires_per_micro_batch_in_registration_order():
    w = torch.nn.Parameter(torch.ones(3))
    hooks, events = StepHooks(), []
    hooks.on_grad_ready(w, lambda p: events.append(("fold", p.grad.clone())))
    hooks.on_grad_ready(w, lambda p: events.append(("count", None)))
    xs = [torch.tensor([1.0, 2.0, 3.0]) * (k + 1) for k in range(3)]
    for x in xs:
        (w * x).sum().backward()
    assert [e for e, _ in events] == ["fold", "count"] * 3
    running = torch.zeros(3)
    for k, x in enumerate(xs):  # d/dw sum(w * x) = x, accumulated
        running += x
        assert torch.equal(events[2 * k][1], running)


def test_layer_ready_fires_before_the_layers_forward():
    lin = torch.nn.Linear(2, 2)
    hooks, events = StepHooks(), []
    lin.register_forward_hook(lambda *_: events.append("forward"))
    hooks.on_layer_ready(lin, lambda: events.append("ready"))
    lin(torch.zeros(1, 2))
    lin(torch.zeros(1, 2))
    assert events == ["ready", "forward"] * 2


def test_runner_fires_first_forward_sent_once_after_f0_before_any_backward():
    torch.manual_seed(0)
    mod = StageModule(CFG, 0, CFG.num_layers, True, True)
    hooks, events = StepHooks(), []
    mod.register_forward_hook(lambda *_: events.append("F"))
    hooks.on_grad_ready(mod.model.norm.weight, lambda p: events.append("B"))
    hooks.on_first_forward_sent(lambda: events.append("U1"))
    hooks.on_first_forward_sent(lambda: events.append("U2"))
    runner = StageRunner(mod, CPUBackend(), 1, 0, "1f1b", None, hooks=hooks)
    runner.trace = []
    x = [torch.randint(0, CFG.vocab_size, (2, 6), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    runner.run_step(0, x, x)
    assert events == ["F", "U1", "U2", "B", "F", "B", "F", "B"]
    assert [a[0] for a in runner.trace].count("U") == 1 and runner.trace[1][0] == "U"
    events.clear()
    runner.run_step(1, x, x)  # once per step
    assert events.count("U1") == 1 and events.index("U1") == 1


def test_runner_without_hook_work_traces_no_u():
    mod = StageModule(CFG, 0, CFG.num_layers, True, True)
    runner = StageRunner(mod, CPUBackend(), 1, 0, "1f1b", None, hooks=StepHooks())
    runner.trace = []
    x = [torch.randint(0, CFG.vocab_size, (2, 6))]
    runner.run_step(0, x, x)
    assert "U" not in [a[0] for a in runner.trace]


def test_optimizer_and_overlap_register_through_the_stage_hooks():
    """bf16 compute: one fold per parameter; overlap: one count per offloaded parameter; rows-first: the
    rest of the update on first forward sent; install_waits: one layer-ready hook per offloaded layer."""
    torch.manual_seed(0)
    mod = StageModule(CFG, 0, CFG.num_layers, True, False).to(torch.bfloat16)
    params = dict(mod.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in params.items()}
    emb = "model.embed_tokens.weight"
    hooks = StepHooks()
    opt = StageOptimizer(params, masters, [emb], CPUBackend(), lr=1e-3, layers=layer_groups(params), overlap=True,
                         hooks=hooks, rows_first=emb)
    assert opt.hooks is hooks and opt.row_name == emb
    offloaded = [n for n in params if n != emb]
    assert len(hooks.handles) == len(params) + len(offloaded)
    assert hooks.has_first_forward_work
    before = len(hooks.handles)
    install_waits(mod, opt, list(opt.host_groups))
    assert len(hooks.handles) - before == len(opt.host_groups) == len(layer_modules(mod)) - 1  # all but embed
    opt.begin_step(1)
    mod(torch.randint(0, CFG.vocab_size, (1, 4))).float().sum().backward()
    assert all(params[n].grad is None for n in params)  # every bf16 .grad was folded by its hook
    assert set(opt.host.queued()) == set(offloaded)  # the count started every offloaded download
    opt.close()
