"""The split search's cost (issue 37: an 8-card MoE plan took 5 min 45 s): its bounds cut the 8-card searches of
the presets to at most a few thousand schedule timelines, it stops at :data:`MAX_TIMELINES` timelines or
:data:`MAX_NODES` partial splits whatever the model, and it chooses the splits it chose before those bounds
(main at 6c4933c, where the 8-card searches below each evaluated up to 20,000 timelines of 2-5 ms).

Requests are the launcher's own (``plan_request`` of a dry-run config on 8 ``furiosa:auto`` cards); exactness
against brute force is ``test_split_search.py``'s.
"""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from npu_train.planner import search
from npu_train.planner.search import MAX_NODES, MAX_TIMELINES, SplitSearchStats, fastest_split

B8 = ",".join(["furiosa:auto"] * 8)
S2048 = ("data.seq_len=2048", "train.micro_batch=1", "train.accum=8")


def _cost_model(preset: str, schedule: str, *overrides: str):
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import Config, compute_dtype
    from npu_train.runtime.job import _preset_config, card_specs, plan_request

    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(
        [f"model.path={preset}", f"backend=[{B8}]", "plan=true", f"train.schedule={schedule}", *overrides]))
    cards = card_specs(resolve_cards(parse_backend_list(list(cfg.backend)), probe=False), cfg)
    mcfg = _preset_config(preset)
    req = plan_request(cfg, mcfg, compute_dtype(cfg.train.dtype, [c.kind for c in cards]), cards, threads=1, dp=1,
                       zero=0, host_ram_bytes=None, host_cores=8)
    return search._cost_model(req), mcfg.num_layers


# (preset, schedule, overrides, the split chosen before, at most this many timelines now)
CASES = [
    ("qwen3-30b-a3b", "1f1b", (), [6] * 8, 10),  # full: offloaded, host-bound
    ("qwen3-30b-a3b", "zb-h1", ("data.seq_len=2048", "train.micro_batch=1", "train.accum=8", "train.recompute=true"),
     [6, 7, 7, 6, 6, 6, 6, 4], 10),
    ("qwen3-30b-a3b", "1f1b", S2048 + ("train.mode=lora",), [4, 4, 5, 6, 7, 9, 8, 5], 5000),
    ("mixtral-8x7b", "1f1b", S2048 + ("train.mode=lora",), [3, 3, 3, 4, 5, 5, 5, 4], 1000),
    ("llama-3.1-8b", "1f1b", ("data.seq_len=2048", "train.accum=16"), [2, 2, 3, 3, 4, 5, 7, 6], 100),
]


@pytest.mark.parametrize("preset,schedule,overrides,before,most", CASES)
def test_eight_card_searches_are_exact_choose_as_before_and_stay_small(preset, schedule, overrides, before, most):
    pm, L = _cost_model(preset, schedule, *overrides)
    st = SplitSearchStats()
    assert fastest_split(pm, L, "auto", stats=st) == before
    assert not st.capped and st.timelines <= most and st.nodes <= MAX_NODES


def test_a_capped_search_keeps_its_choice_and_stops_at_the_caps(monkeypatch):
    """Qwen3-30B-A3B LoRA at the default shape (S 128): many splits within a few % of the fastest, the search stops
    at the timeline cap with the split it chose before; with a node cap of 2,000 it stops there instead."""
    pm, L = _cost_model("qwen3-30b-a3b", "1f1b", "train.mode=lora")
    st = SplitSearchStats()
    assert fastest_split(pm, L, "auto", stats=st) == [7, 7, 7, 7, 7, 6, 6, 1]
    assert st.capped and st.timelines == MAX_TIMELINES and st.nodes <= MAX_NODES
    monkeypatch.setattr(search, "MAX_NODES", 2000)
    st = SplitSearchStats()
    split = fastest_split(pm, L, "auto", stats=st)
    assert st.capped and st.nodes == 2000 and st.timelines < MAX_TIMELINES
    assert split is not None and sum(split) == L
