"""Packed rows (several samples per row): each sample's loss and gradient equal running it alone.

Reference: transformers' ``LlamaForCausalLM`` (eager attention) run on each sample by itself, its loss
written here from the formula (summed next-token cross-entropy over the sample's trained targets). The
product runs the packed row once, with ``positions`` restarting at 0 per sample. Tolerance 1e-6 (fp32),
per sample, relative: ``|loss - ref| / |ref|`` and ``||grad - ref|| / ||ref||`` per parameter (fp32 sums of a
few dozen cross-entropies are ~40 nats, where an absolute 1e-6 is below one ulp).

The same comparison is run with one mask entry opened across a boundary and with positions not
restarting, and must then fail (the tolerance sees both faults). RoPE alone is shift-invariant (scores
depend on ``i - j``), so positions that do not restart matter through the mask derived from them; with
the right mask and RoPE at row offsets the difference stays at rounding (4e-7, measured).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from npu_train.model import load_config, load_tensors  # noqa: E402
from npu_train.model.llama import IGNORE_INDEX, StageModule, full_model  # noqa: E402

transformers = pytest.importorskip("transformers")

TOL = 1e-6
LENGTHS = [(7, 11, 5), (9, 15)]  # sample lengths of row 0 and row 1
ROW = 26  # tokens per row (input positions); the rest of each row is padding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    hcfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                    max_position_embeddings=64, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    ref = transformers.LlamaForCausalLM(hcfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    d = tmp_path_factory.mktemp("tiny_packed")
    ref.save_pretrained(str(d), safe_serialization=True)
    ref = transformers.LlamaForCausalLM.from_pretrained(str(d), attn_implementation="eager",
                                                        dtype=torch.float32, local_files_only=True).eval()
    return str(d), ref


def _samples(seed=3):
    """Per row: list of (ids [L], trained [L] bool: token j is a target of token j-1)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lens in LENGTHS:
        row = []
        for L in lens:
            ids = torch.randint(0, 97, (L,), generator=g)
            trained = torch.rand(L, generator=g) < 0.7
            trained[0] = False  # a sample's first token has no predecessor in the sample
            row.append((ids, trained))
        rows.append(row)
    return rows


def _pack(rows, restart=True):
    """Packed inputs ``[B, ROW]``, positions ``[B, ROW]``, targets ``[B, ROW]`` (IGNORE at boundaries and
    padding) and, per sample, its (row, start, length). Padding continues the last sample's positions."""
    B = len(rows)
    x = torch.zeros(B, ROW, dtype=torch.int64)
    pos = torch.zeros(B, ROW, dtype=torch.int64)
    y = torch.full((B, ROW), IGNORE_INDEX, dtype=torch.int64)
    where = []
    for b, row in enumerate(rows):
        c = 0
        for ids, trained in row:
            L = len(ids)
            x[b, c:c + L] = ids
            pos[b, c:c + L] = torch.arange(L) if restart else torch.arange(c, c + L)
            tgt = torch.where(trained[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
            y[b, c:c + L - 1] = tgt  # the last token's target (the next sample's first) stays IGNORE
            where.append((b, c, L))
            c += L
        last = pos[b, c - 1]
        pos[b, c:] = last + 1 + torch.arange(ROW - c)
    return x, pos, y, where


def _ref_sample(ref, ids, trained):
    """HF alone on one sample: (summed CE over trained targets, {name: grad})."""
    ref.zero_grad()
    logits = ref(ids[None]).logits[0].float()
    tgt = torch.where(trained[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
    loss = F.cross_entropy(logits[:-1], tgt, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _packed_sample_results(model, x, pos, y, where):
    """One packed forward; per sample: (summed CE over its targets, {name: grad of that sum})."""
    logits = model(x, positions=pos)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none").view_as(y)
    out = []
    for b, c, L in where:
        model.zero_grad()
        ls = ce[b, c:c + L].sum()
        ls.backward(retain_graph=True)
        out.append((float(ls.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _max_diff(model, ref, x, pos, y, where, rows):
    samples = [s for r in rows for s in r]
    got = _packed_sample_results(model, x, pos, y, where)
    worst = 0.0
    for (ids, trained), (ls, grads) in zip(samples, got):
        rls, rgrads = _ref_sample(ref, ids, trained)
        worst = max(worst, abs(ls - rls) / abs(rls))
        for n, g in grads.items():
            worst = max(worst, float((g - rgrads[n]).norm() / rgrads[n].norm()))
    return worst


def _model(path, recompute=False):
    cfg = load_config(path)
    m = StageModule(cfg, 0, cfg.num_layers, True, True, recompute=recompute)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    return m


@pytest.mark.parametrize("recompute", [False, True])
def test_packed_row_equals_samples_alone(tiny, recompute):
    path, ref = tiny
    rows = _samples()
    x, pos, y, where = _pack(rows)
    assert _max_diff(_model(path, recompute), ref, x, pos, y, where, rows) < TOL


def test_two_stage_split_packed(tiny):
    """Stage 0 (embed + layer 0) and stage 1 (layer 1 + head), each given the positions, as the pipeline."""
    path, ref = tiny
    cfg = load_config(path)
    rows = _samples(5)
    x, pos, y, where = _pack(rows)
    whole = full_model(cfg)
    whole.load_named_tensors(load_tensors(path, cfg, whole.param_names()))
    s0 = StageModule(cfg, 0, 1, True, False)
    s1 = StageModule(cfg, 1, 2, False, True)
    for s in (s0, s1):
        s.load_named_tensors(load_tensors(path, cfg, s.param_names()))
    with torch.no_grad():
        a = s1(s0(x, positions=pos), positions=pos)
        b = whole(x, positions=pos)
    assert float((a - b).abs().max()) < TOL


def test_unpacked_positions_take_the_causal_path(tiny):
    """positions 0..S-1 in every row: no mask built, same logits as without positions."""
    from npu_train.model.masks import packed_causal_mask

    path, _ = tiny
    m = _model(path)
    x = torch.randint(0, 97, (2, ROW))
    pos = torch.arange(ROW).expand(2, ROW)
    assert packed_causal_mask(pos) is None
    with torch.no_grad():
        assert torch.equal(m(x, positions=pos), m(x))


def test_broken_mask_or_positions_fail(tiny, monkeypatch):
    """The comparison above catches one opened mask entry and positions that do not restart."""
    import npu_train.model.masks as masks

    path, ref = tiny
    rows = _samples()
    x, pos, y, where = _pack(rows)
    model = _model(path)
    # positions counting through the row (RoPE not restarted; the mask still sees no boundary then,
    # so this also checks that a row without restarts is treated as one document)
    x2, pos2, y2, w2 = _pack(rows, restart=False)
    assert _max_diff(model, ref, x2, pos2, y2, w2, rows) > 100 * TOL
    # one entry opened: the second sample's first token sees the first sample's last token
    real = masks.packed_causal_mask

    def opened(p):
        m = real(p).clone()
        b, c, L = where[1]
        m[b, 0, c, c - 1] = True
        return m

    monkeypatch.setattr(masks, "packed_causal_mask", opened)
    assert _max_diff(model, ref, x, pos, y, where, rows) > 100 * TOL
