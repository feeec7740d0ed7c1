"""DPO / IPO against the formulas, written here from the papers (not from npu_train.model.dpo):

- Rafailov et al. 2023, eq. 7: ``L = -log sigmoid(beta * ((lp_w - ref_w) - (lp_l - ref_l)))``, ``lp`` the summed
  log-probability of the completion tokens; cDPO label smoothing ``eps``: ``-(1-eps) log s(z) - eps log s(-z)``;
- Azar et al. 2023, eq. 17 (IPO, with TRL's per-token averages): ``(h - 1/(2 beta))^2``;
- the step's loss is the mean over its pairs, so any cut into micro-batches and any pipeline depth give the
  same gradient: P = 1, 2, 3 StageRunners (threads, queue transport) against one module on the whole batch.
Tolerance: fp32, 1e-6 on the loss, 1e-5 relative per gradient tensor.
"""
from __future__ import annotations

import math

import pytest
import torch

from npu_train.model.dpo import DpoSettings, dpo_losses, sequence_logps
from npu_train.model.llama import StageModule
from npu_train.pipeline.objective import DpoObjective, PairTargets
from test_stage_inprocess import VOCAB, _cfg, _rel, _weights, run_pipeline

SEQ = 8


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("loss,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_pair_losses_equal_the_papers_formulas(loss, eps):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    beta = 0.3
    terms = dpo_losses(pc, pr, rc, rr, DpoSettings(beta=beta, loss=loss, label_smoothing=eps))
    for i in range(6):
        h = (float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i]))
        want = ((h - 1 / (2 * beta)) ** 2 if loss == "ipo" else
                -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h))
        assert abs(float(terms.losses[i]) - want) < 1e-12
        assert abs(float(terms.chosen_rewards[i]) - beta * (float(pc[i]) - float(rc[i]))) < 1e-12
        assert abs(float(terms.rejected_rewards[i]) - beta * (float(pr[i]) - float(rr[i]))) < 1e-12


def test_sequence_logps_sum_only_the_completion_tokens():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[:, :2] = -100
    for fused in (False, True):
        lp, n = sequence_logps(logits.clone().requires_grad_(True), labels, fused=fused)
        for b in range(3):
            want = sum(math.log(float(torch.softmax(logits[b, t].double(), 0)[labels[b, t]]))
                       for t in range(5) if labels[b, t] != -100)
            assert abs(float(lp[b].detach()) - want) < 1e-5
        assert n.tolist() == [3, 3, 3]


def _pairs(k_pairs: int, seed: int):
    """Rows 2i / 2i+1: the same prompt, then different completions; labels -100 over each prompt."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (2 * k_pairs, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (2 * k_pairs, SEQ), generator=g)
    for i in range(k_pairs):
        p = 1 + i % 4  # prompt length (tokens)
        x[2 * i + 1, :p] = x[2 * i, :p]
        y[2 * i: 2 * i + 2, : p - 1] = -100
    return x, y


class _Cpu:
    def upload(self, t):
        return t.clone()

    def synchronize(self):
        pass


def _reference_step(cfg, weights, x, y, ref, s: DpoSettings):
    """Loss and gradients of the whole batch on one module, the loss written from the formulas."""
    model = StageModule(cfg, 0, cfg.num_layers, True, True)
    model.load_named_tensors({n: weights[n] for n in model.param_names()})
    logp = torch.log_softmax(model(x).float(), dim=-1)
    mask = y != -100
    tok = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    lp = tok.sum(-1)
    n = mask.sum(-1)
    r = ref.float()
    if s.loss == "ipo":
        lp, r = lp / n, r / n
    h = (lp[0::2] - r[0::2]) - (lp[1::2] - r[1::2])
    if s.loss == "ipo":
        losses = (h - 1 / (2 * s.beta)) ** 2
    else:
        losses = (-(1 - s.label_smoothing) * torch.nn.functional.logsigmoid(s.beta * h)
                  - s.label_smoothing * torch.nn.functional.logsigmoid(-s.beta * h))
    loss = losses.mean()
    loss.backward()
    return float(loss.detach()), {n_: p.grad.clone() for n_, p in model.named_parameters()}


@pytest.mark.parametrize("loss,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
@pytest.mark.parametrize("P,schedule,M", [(1, "1f1b", 1), (1, "1f1b", 3), (2, "1f1b", 3), (3, "zb", 3),
                                          (3, "gpipe", 2)])
def test_pipeline_dpo_step_equals_single_module(loss, eps, P, schedule, M):
    cfg = _cfg(tied=(P != 2))
    w = _weights(cfg, 3)
    k = 6  # pairs in the step: M micro-batches of 6/M pairs (M = 3: 2 pairs, 4 rows)
    x, y = _pairs(k, 4)
    # the reference model: other weights, so that policy and reference differ
    ref_w = {n: t + 0.02 * torch.randn_like(t) for n, t in w.items()}
    with torch.no_grad():
        ref_model = StageModule(cfg, 0, cfg.num_layers, True, True)
        ref_model.load_named_tensors({n: ref_w[n] for n in ref_model.param_names()})
        ref = sequence_logps(ref_model(x).float(), y)[0].double()
    s = DpoSettings(beta=0.5, loss=loss, label_smoothing=eps)
    want_loss, want_g = _reference_step(cfg, w, x, y, ref, s)
    rows = 2 * k // M
    xs = [x[m * rows:(m + 1) * rows] for m in range(M)]
    ts = [PairTargets(y[m * rows:(m + 1) * rows], ref[m * rows:(m + 1) * rows]) for m in range(M)]
    loss_sum, grads = run_pipeline(cfg, w, xs, ts, P, schedule, objective=DpoObjective(s))
    assert abs(loss_sum / k - want_loss) < 1e-6, (loss_sum / k, want_loss)
    got = {}
    for g in grads:
        got.update(g)
    if "lm_head.weight" not in want_g and "lm_head.weight" in got:  # tied across stages: the pair's sum
        got["model.embed_tokens.weight"] = got["model.embed_tokens.weight"] + got.pop("lm_head.weight")
    for n, t in want_g.items():
        assert _rel(got[n], t) < 1e-5, (n, _rel(got[n], t))


def test_dpo_metrics_are_per_pair_means():
    obj = DpoObjective(DpoSettings(beta=0.1))
    x, y = _pairs(2, 5)
    cfg = _cfg(tied=True)
    model = StageModule(cfg, 0, cfg.num_layers, True, True)
    model.load_named_tensors({n: t for n, t in _weights(cfg, 6).items() if n in model.param_names()})
    ref = torch.tensor([-30.0, -10.0, -25.0, -40.0], dtype=torch.float64)
    with torch.no_grad():
        logits = model(x)
        lp = sequence_logps(logits.float(), y)[0].double()
        _, sums = obj.loss_sum(logits, PairTargets(y, ref), _Cpu(), False)
    m = obj.metrics(sums, 2)
    cr, rr = 0.1 * (lp[0::2] - ref[0::2]), 0.1 * (lp[1::2] - ref[1::2])
    assert abs(m["rewards/chosen"] - float(cr.mean())) < 1e-5
    assert abs(m["rewards/rejected"] - float(rr.mean())) < 1e-5
    assert m["rewards/accuracies"] == float((cr > rr).double().mean())
    assert abs(m["rewards/margins"] - float((cr - rr).mean())) < 1e-5
    assert abs(m["logps/chosen"] - float(lp[0::2].mean())) < 1e-4
    assert abs(m["logps/rejected"] - float(lp[1::2].mean())) < 1e-4


def test_pair_sampler_keeps_both_rows_of_a_pair_in_one_micro_batch():
    from npu_train.data.sampler import PairSampler, StepSampler

    ps = PairSampler(40, 4, 3, seed=7, dp_rank=1, dp_size=2)
    pairs = StepSampler(20, 2, 3, seed=7, dp_rank=1, dp_size=2)  # the same draw over pair indices
    for step in range(5):
        for rows, pr in zip(ps.micro_batches_for_step(step), pairs.micro_batches_for_step(step)):
            assert rows.tolist() == [r for p in pr.tolist() for r in (2 * p, 2 * p + 1)]
    with pytest.raises(ValueError, match="even"):
        PairSampler(40, 3, 1, seed=0)
    with pytest.raises(ValueError, match="preference pairs"):
        ps.load_state_dict(pairs.state_dict())


@pytest.mark.parametrize("overrides,match", [
    (["train.objective=dpo"], "data.format=preference"),
    (["train.objective=dpo", "data.format=preference", "train.micro_batch=3"], "must be even"),
    (["train.objective=dpo", "data.format=preference", "dpo.beta=0"], "dpo.beta"),
    (["train.objective=dpo", "data.format=preference", "dpo.loss=kto"], "sigmoid or ipo"),
    (["train.objective=dpo", "data.format=preference", "dpo.loss=ipo", "dpo.label_smoothing=0.1"], "applies to dpo.loss=sigmoid only"),
    (["data.format=preference"], "train.objective=dpo"),
    (["train.objective=ppo"], "sft or dpo"),
])
def test_dpo_config_refusals_name_the_fix(overrides, match):
    from omegaconf import OmegaConf

    from npu_train.config import Config, ConfigError, validate

    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_reference_spec_computes_only_missing_rows_and_refuses_a_full_resume_without_them(tmp_path):
    from npu_train.runtime.reference import ReferenceError, reference_spec, save_reference

    kw = dict(n_train=8, n_val=2, val_rows=[0, 1])
    fresh = reference_spec("k" * 64, str(tmp_path / "ck"), True, str(tmp_path / "cache"), train_rows=[0, 1, 4, 5],
                           resuming=False, lora=False, **kw)
    assert fresh.train_rows == (0, 1, 4, 5) and fresh.val_rows == (0, 1) and fresh.compute
    train = torch.full((8,), float("nan"), dtype=torch.float64)
    train[[0, 1, 4, 5]] = torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64)
    save_reference(fresh, train, torch.tensor([-5.0, -6.0], dtype=torch.float64))
    more = reference_spec("k" * 64, str(tmp_path / "ck2"), True, str(tmp_path / "cache"), train_rows=[0, 1, 2, 3],
                          resuming=False, lora=False, **kw)  # a new run: the cache has rows 0, 1 and the val rows
    assert more.train_rows == (2, 3) and more.val_rows == ()
    with pytest.raises(ReferenceError, match="cannot be recomputed"):
        reference_spec("k" * 64, str(tmp_path / "ck"), True, None, train_rows=[6, 7], resuming=True, lora=False, **kw)
    lora = reference_spec("k" * 64, str(tmp_path / "ck"), True, None, train_rows=[6, 7], resuming=True, lora=True, **kw)
    assert lora.train_rows == (6, 7)  # LoRA: the base is still there, adapters disabled


def test_preference_rows_are_not_packed():
    from omegaconf import OmegaConf

    from npu_train.runtime.job import packed_rows

    assert packed_rows(OmegaConf.create({"format": "preference", "pack": True})) is False
    assert packed_rows(OmegaConf.create({"format": "chat", "pack": True})) is True


@pytest.mark.parametrize("n,mb,dp,start", [(10, 4, 2, 0), (4, 4, 2, 0), (4, 4, 3, 0), (4, 4, 3, 2), (0, 2, 2, 1),
                                            (12, 2, 1, 0), (22, 4, 3, 1)])
def test_replica_shares_are_whole_micro_batches_round_robin(n, mb, dp, start):
    """The reference pass's shares: the rows cut into micro-batches of ``mb`` in order (the last shorter), micro-batch
    ``j`` on replica ``(start + j) % dp``; so the shares are disjoint, cover the rows, and re-cut into ``mb`` they give
    the very micro-batches one replica would run (the same values, bit for bit). Fewer micro-batches than replicas:
    the others get nothing."""
    from npu_train.runtime.reference import replica_shares

    rows = [3 * i + 1 for i in range(n)]  # any increasing row indices
    mbs = [rows[a:a + mb] for a in range(0, n, mb)]
    shares = replica_shares(rows, mb, dp, start)
    assert len(shares) == dp
    for k in range(dp):
        mine = [c for j, c in enumerate(mbs) if (start + j) % dp == k]
        assert shares[k] == [r for c in mine for r in c]
        assert [shares[k][a:a + mb] for a in range(0, len(shares[k]), mb)] == mine
    assert sorted(r for s in shares for r in s) == rows
    assert sum(1 for s in shares if s) == min(dp, len(mbs))


def test_pass_shares_continue_the_round_from_train_to_val():
    """7 train micro-batches (the last of 2 rows) on replicas 0 1 2 0 1 2 0, then the 2 val ones on 1 and 2."""
    from npu_train.runtime.reference import pass_shares
    from npu_train.runtime.spec import ReferenceSpec

    ref = ReferenceSpec(None, None, "k" * 64, train_rows=tuple(range(26)), val_rows=tuple(range(8)))
    train, val = pass_shares(ref, 4, 3)
    assert train == [[0, 1, 2, 3, 12, 13, 14, 15, 24, 25], [4, 5, 6, 7, 16, 17, 18, 19], [8, 9, 10, 11, 20, 21, 22, 23]]
    assert val == [[], [0, 1, 2, 3], [4, 5, 6, 7]]


def test_reference_plan_line_divides_the_pass_over_the_replicas():
    """The plan's estimate of the pass: the busiest replica's sequences / (micro_batch x accum) x step / 3."""
    from types import SimpleNamespace

    from npu_train.runtime.job import reference_plan_line
    from npu_train.runtime.spec import ReferenceSpec

    ref = ReferenceSpec(None, None, "k" * 64, train_rows=tuple(range(28)), val_rows=(0, 1, 2, 3))  # 8 micro-batches
    data = SimpleNamespace(n_train=40, n_val=8)
    tr = SimpleNamespace(micro_batch=4, accum=2, mode="full")
    dpo = SimpleNamespace(loss="sigmoid", beta=0.1, label_smoothing=0.0)
    # one replica: 32 rows / 8 per step x 30 s / 3 = 40 s; two: 16 rows, 20 s; three: 3 + 3 + 2 micro-batches
    # (train 0 1 2 0 1 2 0, val 1), 15 s
    for dp, want in ((1, 40), (2, 20), (3, 15)):
        line = reference_plan_line(ref, data, tr, 30.0, dpo, dp)
        assert f"about {want} s by the plan" in line, line
        assert ("spread over the" in line) == (dp > 1)
