"""The split search's cuts keep it exact on the launcher's own requests (full and LoRA, dense and MoE, 2 and 8
cards, every schedule ``train.schedule=auto`` tries, with and without the attention core recomputed): the
split :func:`fastest_split` chooses is the one the exhaustive reference chooses, every split planned with each
card's auto resident count (:meth:`CostModel.max_resident`) and its step time from :meth:`CostModel.step_time`,
the fastest that fits, ties to the balanced split, else the lexicographically smallest (2026-12-07: the LoRA
8-card searches visit ~300,000 partial splits each, and their loop was made cheaper).

The 8-card requests keep 12 of the model's layers (330 splits to plan by brute force); the 2-card ones all.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from npu_train.planner import search
from npu_train.planner.search import balanced_split, fastest_split


def _request(preset: str, cards: int, schedule: str, *overrides: str):
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import Config, compute_dtype
    from npu_train.runtime.job import _preset_config, card_specs, plan_request

    backend = ",".join(["furiosa:auto"] * cards)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(
        [f"model.path={preset}", f"backend=[{backend}]", "plan=true", f"train.schedule={schedule}", *overrides]))
    specs = card_specs(resolve_cards(parse_backend_list(list(cfg.backend)), probe=False), cfg)
    return plan_request(cfg, _preset_config(preset), compute_dtype(cfg.train.dtype, [c.kind for c in specs]), specs,
                        threads=1, dp=1, zero=0, host_ram_bytes=None, host_cores=2)


def _exhaustive(pm, L: int):
    """The split every split planned chooses (module docstring), or None when none fits."""
    P = pm.P
    times = {}
    for cuts in itertools.combinations(range(1, L), P - 1):
        b = (0,) + cuts + (L,)
        sp = [b[k + 1] - b[k] for k in range(P)]
        res = [pm.max_resident(i, n) for i, n in enumerate(sp)]
        if min(res) >= 0:
            times[tuple(sp)] = pm.step_time(sp, res)
    if not times:
        return None
    best = min(times.values())
    ties = sorted(sp for sp, t in times.items() if t <= best * (1 + 1e-9))
    bal = tuple(balanced_split(L, P))
    return list(bal if bal in ties else ties[0])


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "llama-3.2-1b"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("cards", [2, 8])
@pytest.mark.parametrize("schedule", ["1f1b", "zb", "zb-h2", "zbv"])
@pytest.mark.parametrize("core", [False, True])
def test_search_chooses_the_exhaustive_split(preset, mode, cards, schedule, core):
    req = _request(preset, cards, schedule, f"train.mode={mode}")
    if cards == 8:
        req = replace(req, model=replace(req.model, num_layers=12))
    req = replace(req, shape=replace(req.shape, recompute_attention=core))
    pm = search._cost_model(req)
    L = req.model.num_layers
    st = search.SplitSearchStats()
    got = fastest_split(pm, L, "auto", stats=st)
    assert not st.capped
    want = _exhaustive(pm, L)
    assert got == want
