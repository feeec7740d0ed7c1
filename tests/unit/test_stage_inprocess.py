"""StageRunner in one process: P runners in P threads joined by a queue-based BoundaryComm.

No processes, no gloo, no shared memory: a schedule or stage change is checked in seconds. The
reference is one module holding all layers with the same weights, trained on the step's
micro-batches concatenated into one batch, with the loss written from its formula:
``sum of token cross-entropies / number of target tokens of the step`` (labels equal to -100 do
not count); its gradients come from plain autograd. Tolerance: fp32, 1e-5 relative per tensor.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule, checkpoint_source_name
from npu_train.pipeline.stage import StageRunner
from stage_threads import run_stage_threads, wake_links

VOCAB, SEQ, MB = 96, 8, 2
SPLITS = {1: [5], 2: [3, 2], 3: [2, 1, 2]}  # layers per stage (uneven on purpose)
TIMEOUT_S = 20.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the card threads share one process


class QueueComm:
    """:class:`npu_train.pipeline.stage.BoundaryComm` over in-process mailboxes.

    One mailbox per boundary and direction, messages matched by ``(step, micro)`` as the real
    transport does; a sender blocks while ``slots`` messages of its link are unreceived (the
    transport's credit-based flow control), so deadlocks under finite slots show up here too.
    """

    def __init__(self, links: dict, stage: int, slots: int, abort: threading.Event):
        self.links, self.s, self.slots, self.abort = links, stage, slots, abort

    def _wait(self, cv, ready, what):
        if not cv.wait_for(lambda: ready() or self.abort.is_set(), TIMEOUT_S):
            raise TimeoutError(f"stage {self.s}: {what} (deadlock?)")
        if self.abort.is_set():
            raise RuntimeError(f"stage {self.s}: another stage failed")

    def _send(self, key, step, micro, t):
        cv, box = self.links[key]
        with cv:
            self._wait(cv, lambda: len(box) < self.slots, f"no free slot on {key} for micro-batch {micro}")
            box[(step, micro)] = t.detach().clone()
            cv.notify_all()

    def _recv(self, key, step, micro):
        cv, box = self.links[key]
        with cv:
            self._wait(cv, lambda: (step, micro) in box, f"micro-batch {micro} never arrived on {key}")
            t = box.pop((step, micro))
            cv.notify_all()
            return t

    def send_act(self, step, micro, t):
        self._send(("act", self.s), step, micro, t)

    def recv_act(self, step, micro):
        return self._recv(("act", self.s - 1), step, micro)

    def send_grad(self, step, micro, t):
        self._send(("grad", self.s), step, micro, t)

    def recv_grad(self, step, micro):
        return self._recv(("grad", self.s + 1), step, micro)


class _Cpu:
    def upload(self, t):
        return t.clone()

    def synchronize(self):
        pass


def _cfg(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=5, num_heads=4,
                       num_kv_heads=2, tie_word_embeddings=tied, max_position_embeddings=64)


def _reference(cfg, weights, inputs, labels):
    """Loss and gradients of the whole model on the concatenated micro-batches (plain autograd)."""
    model = StageModule(cfg, 0, cfg.num_layers, True, True)
    model.load_named_tensors({n: weights[n] for n in model.param_names()})
    x, y = torch.cat(inputs), torch.cat(labels)
    logits = model(x)
    ce_sum = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    (ce_sum / (y != -100).sum()).backward()
    return float(ce_sum.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_pipeline(cfg, weights, inputs, labels, P, schedule, slots=1, early_last=None, traces=None, objective=None):
    """One optimizer step of P StageRunners in P threads; returns (loss_sum, {name: grad} per stage).
    ``early_last(module) -> (params, done)``: the last stage's ``early`` argument of ``run_step``.
    ``traces``: a list of P lists, each stage's :attr:`StageRunner.trace` (None: not recorded).
    ``objective``: the runners' objective (None: next-token cross-entropy); ``labels`` then hold its targets."""
    bounds, first = [], 0
    for n in SPLITS[P]:
        bounds.append((first, first + n))
        first += n
    links = {(k, s): (threading.Condition(), {}) for k in ("act", "grad") for s in range(P)}
    results, abort = [None] * P, threading.Event()

    def work(s):
        mod = StageModule(cfg, *bounds[s], s == 0, s == P - 1)
        mod.load_named_tensors({n: weights[checkpoint_source_name(cfg, n)] for n in mod.param_names()})
        runner = StageRunner(mod, _Cpu(), P, s, schedule, QueueComm(links, s, slots, abort), objective=objective)
        runner.trace = traces[s] if traces is not None else None
        if s in (0, P - 1):
            early = early_last(mod) if early_last is not None and s == P - 1 else None
            res = runner.run_step(0, inputs if s == 0 else None, labels if s == P - 1 else None, early=early)
        else:
            res = runner.run_middle(0, len(inputs))
        results[s] = (res, {n: p.grad for n, p in mod.named_parameters()})

    run_stage_threads(P, work, wake_links(abort, links), 2 * TIMEOUT_S)
    return results[-1][0]["loss_sum"], [g for _, g in results]


def _data(M, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, VOCAB, (MB, SEQ), generator=g) for _ in range(M)]
    labels = []
    for m in range(M):
        y = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        y[:, : m % 3] = -100  # a different number of target tokens per micro-batch
        labels.append(y)
    return inputs, labels


def _weights(cfg, seed):
    torch.manual_seed(seed)
    full = StageModule(cfg, 0, cfg.num_layers, True, True)
    with torch.no_grad():
        for n, p in full.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))  # norms away from 1
            else:
                p.normal_(0.0, 0.08)
    return {n: p.detach().clone() for n, p in full.named_parameters()}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("M", [1, 2, 4, 5])
def test_stage_gradients_match_single_module(schedule, P, M):
    cfg = _cfg(tied=(P != 2))  # tied embeddings span the first and last stage for P = 3
    weights = _weights(cfg, seed=P * 10 + M)
    inputs, labels = _data(M, seed=M)
    ref_loss, ref_grads = _reference(cfg, weights, inputs, labels)
    loss_sum, stage_grads = run_pipeline(cfg, weights, inputs, labels, P, schedule)
    assert abs(loss_sum - ref_loss) / ref_loss < 1e-5
    got: dict[str, torch.Tensor] = {}
    for grads in stage_grads:
        for n, g in grads.items():
            assert g is not None, f"{n}: no gradient"
            src = checkpoint_source_name(cfg, n)  # tied head on the last stage: sums into the embedding
            got[src] = got[src] + g if src in got else g
    assert got.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert _rel(got[n], g) < 1e-5, f"{n}: rel diff {_rel(got[n], g):.2e}"


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("P,M", [(2, 5), (3, 8)])
def test_early_gradient_is_final_before_the_deferred_weight_passes(schedule, P, M):
    """run_step(early=(params, done)): at done() the lm_head gradient already has its final value,
    bit for bit; in split-backward schedules the last stage's layer W passes still run after done()
    (so the tied gradient can leave early); the step's gradients are those of a run without early."""
    cfg = _cfg(tied=False)
    weights = _weights(cfg, seed=7)
    inputs, labels = _data(M, seed=3)
    seen = {}

    def early_last(mod):
        head = dict(mod.named_parameters())["lm_head.weight"]

        def done():
            seen.update({n: None if p.grad is None else p.grad.clone() for n, p in mod.named_parameters()})
        return [head], done

    _, plain = run_pipeline(cfg, weights, inputs, labels, P, schedule)
    _, early = run_pipeline(cfg, weights, inputs, labels, P, schedule, early_last=early_last)
    for a, b in zip(plain, early):
        for n in a:
            assert torch.equal(a[n], b[n]), n
    assert torch.equal(seen["lm_head.weight"], early[-1]["lm_head.weight"])
    layer_final = [n for n, g in early[-1].items() if "layers." in n and torch.equal(seen[n], g)
                   if seen[n] is not None]
    if schedule in ("zb", "zb-h1", "zb-h2"):  # deferred layer W passes ran after done()
        assert not layer_final, f"{schedule}: layer gradients already final at done(): {layer_final[:3]}"
    else:  # no split: done() after the last action
        assert len(layer_final) == sum("layers." in n for n in early[-1])


def test_zb_refuses_recompute():
    from npu_train.errors import ConfigError

    mod = StageModule(_cfg(False), 0, 2, True, False, recompute=True)
    with pytest.raises(ConfigError, match="recompute"):
        StageRunner(mod, _Cpu(), 2, 0, "zb", None)


def test_config_accepts_zb_and_refuses_it_with_recompute():
    from omegaconf import OmegaConf

    from npu_train.config import Config, validate
    from npu_train.errors import ConfigError

    def cfg(*dotlist):
        return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(dotlist)))

    validate(cfg("train.schedule=zb"))
    with pytest.raises(ConfigError, match="train.recompute"):
        validate(cfg("train.schedule=zb", "train.recompute=true"))
    validate(cfg("train.schedule=zbv"))
    validate(cfg("train.schedule=interleaved", "train.recompute=true"))  # interleaved 1F1B recomputes
    with pytest.raises(ConfigError, match="train.recompute"):
        validate(cfg("train.schedule=zbv", "train.recompute=true"))
    with pytest.raises(ConfigError, match="use auto, 1f1b, gpipe, zb, zb-h1, zb-h2, zbv or interleaved"):
        validate(cfg("train.schedule=zbx"))


def test_compute_cpu_seconds_are_read_around_each_compute_action():
    """``compute_cpu_s``: the CPU clock is read at the start and end of each F and B of a 1F1B step (2 x M
    intervals); a scripted clock that advances 1 s a read gives 1 s an interval, 2 M in all, whatever the wall
    clock. A backend that is not a cpu has no CPU clock (None)."""
    from npu_train.pipeline.stage import work_clock

    class _CpuKind(_Cpu):
        kind = "cpu"

    cfg, M = _cfg(tied=False), 3
    mod = StageModule(cfg, 0, cfg.num_layers, True, True)
    runner = StageRunner(mod, _CpuKind(), 1, 0, "1f1b", None)
    assert runner.cpu_clock is work_clock("cpu")
    ticks = iter(range(1000))
    runner.cpu_clock = lambda: float(next(ticks))
    inputs, labels = _data(M, seed=1)
    res = runner.run_step(0, inputs, labels)
    assert res["compute_cpu_s"] == 2 * M
    assert StageRunner(mod, _Cpu(), 1, 0, "1f1b", None).run_step(0, inputs, labels)["compute_cpu_s"] is None
    assert work_clock("cpu") is __import__("time").thread_time  # one torch thread (the fixture)
    assert work_clock("cuda") is None


def test_layer_check_runs_before_each_layer_and_after_its_backward():
    """``StageModule.layer_check`` (a cpu card's heap-guard check) runs before each decoder layer's forward and,
    through a hook on the layer's input, once its backward made that input's gradient: 2 per layer and
    micro-batch in training, 1 in a forward without gradients; the graph cuts of a split backward keep it."""
    cfg = _cfg(False)
    m = StageModule(cfg, 0, 3, True, False)
    calls = []
    m.layer_check = lambda *g: calls.append("B" if g else "F")
    x = torch.randint(0, VOCAB, (2, 8))
    y = m(x)
    assert calls == ["F"] * 3
    y.sum().backward()
    assert calls == ["F"] * 3 + ["B"] * 3
    with torch.no_grad():
        m(x)
    assert calls == ["F"] * 3 + ["B"] * 3 + ["F"] * 3
    calls.clear()
    h = torch.randn(2, 8, cfg.hidden_size, requires_grad=True)
    mid = StageModule(cfg, 1, 4, False, False)
    mid.layer_check = m.layer_check
    cuts = []
    out = mid(h, cuts=cuts)
    from npu_train.pipeline.backward import backward_input

    backward_input(out, torch.ones_like(out), h, [p for p in mid.parameters()], cuts=cuts)
    assert calls == ["F"] * 3 + ["B"] * 3, calls
