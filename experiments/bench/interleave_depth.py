"""How far would interleaved 1F1B with ``v`` chunks per card take the 8-card plans? (issue 38, a study)

The project's ``interleaved`` schedule holds two chunks per card (``pipeline/schedule.py::_interleaved``). Narayanan et
al. 2021 (§2.2, Megatron-LM's virtual pipeline stages) generalise it to ``v`` chunks: card ``r`` holds virtual stages
``r, P + r, ..., (v-1) P + r``, the bubble shrinks to ``(P-1)/(v M)`` of the ideal time, and every chunk boundary is a
card crossing. This script builds that order here (:func:`interleaved_order`, Megatron's
``get_model_chunk_id`` and warm-up ``2 (P-r-1) + (v-1) P``; equal to the module's order at ``v = 2``), checks it free of
deadlock with the module's own simulator (``schedule._simulate``, unbounded and 2-slot links and the runtime's default
``min(M, P) + 1``), and prices it with the planner's own numbers for the launcher's request (the path
``tests/unit/test_split_search_cost.py`` uses):

- per-layer forward / backward FLOPs of a layer recomputed whole or kept (``CostModel.layer_fbw_parts``), the head's
  (``CostModel.head_fbw``), at the card's rate; every virtual stage's boundary copies as ``CostModel.boundary_copies``
  prices them (one ``[b, S, H]`` copy card->host and one host->card per neighbour on another card, in F and in B);
- the timeline of the module (``schedule._program`` / ``_run_program``: earliest start, each card in its order);
- per card, the memory terms of the planner's ``MemoryModel.stage`` with the activations replaced by the peak over the
  card's ``v``-chunk order of what its chunk micro-batches hold (a chunk's layers: a layer recomputed whole keeps its
  input, a kept one its activations with the attention core recomputed; the head's saved log-probabilities on the last
  virtual stage), plus one layer's recomputed activations, and the workspace recomputed on the new body
  (``MemoryModel.workspace``);
- the fewest layers recomputed whole per card that fit the planner's limit (``CostModel.limit``: capacity less the
  headroom), chunk 0's layers first, as ``train.recompute_layers=fewest`` chooses them.

Checks against the planner: at ``v = 2`` the durations equal ``CostModel.stage_durations``, the per-card recompute
counts and memory totals equal the planner's, and the phase equals ``CostModel.phase`` (asserted; the script stops
otherwise). Split: the layers evenly over the cards (the planner's choice for 70B LoRA interleaved); a card's layers
over its chunks as evenly as they go, the earlier chunks taking the extra ones.

Run (about a minute; no torch beyond what the planner imports, no card)::

    PYTHONPATH=src python experiments/bench/interleave_depth.py
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Optional

from omegaconf import OmegaConf

from npu_train.pipeline import schedule as S
from npu_train.pipeline.schedule import Action

B8 = ",".join(["furiosa:auto"] * 8)
GiB = 2 ** 30


# ---------------------------------------------------------------------------------------------- the v-chunk order
def interleaved_order(P: int, M: int, v: int, r: int) -> list[Action]:
    """Card ``r``'s interleaved 1F1B with ``v`` chunks (``M % P == 0``): the ``k``-th forward is micro-batch
    ``(k // vP) P + k % P`` on chunk ``(k % vP) // P``, backwards take the chunks in reverse; ``2 (P-r-1) + (v-1) P``
    warm-up forwards (capped at ``v M``), then one forward and one backward. ``v = 1``: the module's 1F1B."""
    if v == 1:
        return S.build_schedule("1f1b", P, M, r)
    return S._interleaved(P, M, r, v)


@contextlib.contextmanager
def v_chunks(v: int):
    """The module's simulator and timeline with ``v`` chunks per card under the name ``interleaved`` (virtual stage
    ``chunk * P + card``): its three layout functions swapped for the time of the block."""
    saved = S.chunks_per_card, S.virtual_stage, S.card_of
    S.chunks_per_card = lambda kind: v if kind == "interleaved" else saved[0](kind)
    S.virtual_stage = lambda kind, P, card, chunk: chunk * P + card
    S.card_of = lambda kind, P, vs: (vs % P, vs // P)
    try:
        yield
    finally:
        S.chunks_per_card, S.virtual_stage, S.card_of = saved


def check_deadlock_free(P: int, M: int, v: int) -> int:
    """Unit ticks of the ``v``-chunk order in the module's simulator with unbounded, 2-slot and ``min(M, P) + 1``-slot
    links (the runtime's default); raises RuntimeError on deadlock."""
    kind = "1f1b" if v == 1 else "interleaved"
    scheds = [interleaved_order(P, M, v, r) for r in range(P)]
    with v_chunks(v):
        return max(S._simulate(kind, P, M, scheds, slots, False) for slots in (None, 2, min(M, P) + 1))


def timeline(P: int, M: int, v: int, dur: tuple) -> tuple[list, list]:
    """Per card ``(end, busy)`` seconds of the ``v``-chunk order with ``dur = (F, B, W)`` per virtual stage (the
    module's ``_program`` / ``_run_program``; B unsplit: its W inside)."""
    kind = "1f1b" if v == 1 else "interleaved"
    scheds = [interleaved_order(P, M, v, r) for r in range(P)]
    with v_chunks(v):
        prog = S._program(kind, P, M, scheds, False)
    return S._run_program(prog, P, dur, None)


def chunk_layers(n: int, v: int) -> list[int]:
    """A card's ``n`` layers over its ``v`` chunks, the earlier chunks taking the extra ones."""
    return [n // v + (1 if c < n % v else 0) for c in range(v)]


# ---------------------------------------------------------------------------------------------- the planner's numbers
def request(preset: str, *overrides: str):
    """The launcher's plan request on 8 ``furiosa:auto`` cards (``tests/unit/test_split_search_cost.py``'s path)."""
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import Config, compute_dtype
    from npu_train.runtime.job import _preset_config, card_specs, plan_request

    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(
        [f"model.path={preset}", f"backend=[{B8}]", "plan=true", *overrides]))
    cards = card_specs(resolve_cards(parse_backend_list(list(cfg.backend)), probe=False), cfg)
    return plan_request(cfg, _preset_config(preset), compute_dtype(cfg.train.dtype, [c.kind for c in cards]), cards,
                        threads=1, dp=1, zero=0, host_ram_bytes=None, host_cores=8)


class Pricer:
    """The planner's per-layer times, copies and memory terms of one request, for ``v`` chunks per card."""

    def __init__(self, pm, split: list[int]):
        self.pm, self.split, self.P = pm, split, len(split)
        self.mm = pm.memory
        self.M = pm.shape.micro_batches
        self.x = self.mm.dtype_bytes * pm.shape.tokens_per_micro_batch * pm.model.hidden_size  # one crossing

    def copies(self, i: int, vs: int, V: int) -> tuple[float, float]:
        """``CostModel.boundary_copies`` with ``v`` chunks: every neighbour virtual stage is on another card."""
        rt = self.pm.rates[i]
        prev, nxt = vs > 0, vs < V - 1
        up, down = self.x / rt.h2d_bytes_per_s, self.x / rt.d2h_bytes_per_s
        return (up if prev else 0.0) + (down if nxt else 0.0), (up if nxt else 0.0) + (down if prev else 0.0)

    def durations(self, v: int, k: list[int], spread: bool = False) -> tuple:
        """``(F, B, W)`` seconds per virtual stage (W 0: unsplit, inside B) with ``k[i]`` layers of card ``i``
        recomputed whole, chunk 0's first (as the runtime, the memory model and, since this study,
        ``CostModel.stage_durations`` take them), or ``spread``: the card's recompute shared by its chunks in
        proportion to their layers (``CostModel.stage_durations`` before this study); and per card the recompute
        seconds per micro-batch."""
        pm, P = self.pm, self.P
        V = v * P
        redo, kept = pm.layer_fbw_parts
        F, B = [0.0] * V, [0.0] * V
        rc = [0.0] * P
        for i, n in enumerate(self.split):
            rate = pm.rates[i].device_flops
            left = k[i]
            for c, m in enumerate(chunk_layers(n, v)):
                kc = min(left, m) if not spread else k[i] * m / n
                left -= kc
                vs = c * P + i
                f = (kc * redo[0] + (m - kc) * kept[0]) / rate
                b = (kc * (redo[1] + redo[2]) + (m - kc) * (kept[1] + kept[2])) / rate
                cf, cb = self.copies(i, vs, V)
                if vs == V - 1:  # the head
                    hr = rate * pm.rates[i].head_flops_ratio
                    f += pm.head_fbw[0] / hr
                    b += (pm.head_fbw[1] + pm.head_fbw[2]) / hr
                F[vs], B[vs] = f + cf, b + cb
                rc[i] += (kc * pm.layer_recompute[0] + (m - kc) * pm.layer_recompute[1]) / rate
        return (F, B, [0.0] * V), rc

    def activations(self, i: int, v: int, kk: int) -> float:
        """Peak bytes card ``i``'s chunk micro-batches hold over its ``v``-chunk order, ``kk`` layers recomputed whole
        (``MemoryModel._held_per_chunk`` per chunk), plus one layer's recomputed activations when ``kk > 0``."""
        mm, P = self.mm, self.P
        act = mm._activations_per_layer(i)
        left, held = kk, []
        for c, m in enumerate(chunk_layers(self.split[i], v)):
            kc = min(left, m)
            left -= kc
            head = c * P + i == v * P - 1
            held.append(kc * mm.layer_input_bytes + (m - kc) * act + (mm.mask_bytes if m else 0)
                        + (mm.saved_logits if head else 0))
        last = {}
        order = interleaved_order(P, self.M, v, i)
        for j, a in enumerate(order):
            if a.kind == "B":
                last[(a.micro, a.chunk)] = j
        total = peak = 0.0
        for j, a in enumerate(order):
            total += held[a.chunk] if a.kind == "F" else -held[a.chunk] if last.get((a.micro, a.chunk)) == j else 0.0
            peak = max(peak, total)
        return peak + (act if kk else 0)

    def memory(self, i: int, v: int, kk: int) -> tuple[float, float]:
        """``(total, activations)`` bytes of card ``i``: the planner's terms at the same layers with the activations
        replaced by :meth:`activations` and the workspace recomputed on the new body."""
        mm = self.mm
        n = self.split[i]
        sm = mm.stage(i, n, n, self.pm.rates[i].process_baseline_bytes, kk).mem
        body = sm["total"] - sm["baseline"] - sm["workspace"]
        act = self.activations(i, v, kk)
        body += act - sm["activations"]
        return sm["baseline"] + body + mm.workspace(i, int(body), mm.hole_churn(i, n, kk)), act

    def fewest(self, i: int, v: int) -> Optional[int]:
        """The fewest layers of card ``i`` recomputed whole with which it fits ``CostModel.limit``; None: none fits."""
        cap = self.pm.limit(i)
        return next((kk for kk in range(self.split[i] + 1) if self.memory(i, v, kk)[0] <= cap), None)


def price(pm, split: list[int], v: int, model_flops: float, peak_flops: float) -> dict:
    """Step, bubble, recompute, copies, MFU and memory of ``v`` chunks per card at the fewest recomputed layers."""
    pr = Pricer(pm, split)
    P, M = pr.P, pr.M
    k = [pr.fewest(i, v) for i in range(P)]
    if any(x is None for x in k):
        return {"v": v, "fits": False}
    dur, rc = pr.durations(v, k)
    end, busy = timeline(P, M, v, dur)
    phase = max(end)
    side = max(sum(pm.side_time(i, pm.cost(i, n, n))) for i, n in enumerate(split))  # optimizer; LoRA ~0
    step = phase + side
    spread = max(timeline(P, M, v, pr.durations(v, k, spread=True)[0])[0]) + side
    free = max(timeline(P, M, v, pr.durations(v, [0] * P)[0])[0]) + side  # as if no layer had to be recomputed
    V = v * P
    copies = [M * sum(sum(pr.copies(i, c * P + i, V)) for c in range(v)) for i in range(P)]
    mem = [pr.memory(i, v, k[i]) for i in range(P)]
    return {"v": v, "fits": True, "k": k, "step": step, "phase": phase, "bubble": [phase - b for b in busy],
            "busy": busy, "side": side,
            "rc": [M * x for x in rc], "copies": copies, "mfu": model_flops / (step * peak_flops),
            "mem": [m for m, _ in mem], "act": [a for _, a in mem], "cap": pm.limit(0),
            "ticks": check_deadlock_free(P, M, v), "spread": spread,
            "free": free}


def check_against_planner(pm, split: list[int]) -> None:
    """At ``v = 2`` this script's order, durations, recompute counts, memory and phase equal the planner's."""
    P, M = len(split), pm.shape.micro_batches
    for r in range(P):
        assert interleaved_order(P, M, 2, r) == S.build_schedule("interleaved", P, M, r), r
    costs = [pm.cost(i, n, n) for i, n in enumerate(split)]
    pr = Pricer(pm, split)
    k = [pr.fewest(i, 2) for i in range(P)]
    assert k == [c.recomputed for c in costs], (k, [c.recomputed for c in costs])
    mine, _ = pr.durations(2, k)
    tf, tb, tw = pm.stage_durations(costs)
    for a, b in zip(mine[:2], (tf, [x + y for x, y in zip(tb, tw)])):  # unsplit: W inside B
        assert all(abs(x - y) <= 1e-9 * max(1.0, abs(y)) for x, y in zip(a, b)), (a, b)
    for i, n in enumerate(split):
        got, want = pr.memory(i, 2, k[i])[0], pm.cost(i, n, n).mem["total"]
        assert abs(got - want) <= 1e-6 * want, (i, got, want)
    phase = max(timeline(P, M, 2, mine)[0])
    assert abs(phase - pm.phase(costs)) <= 1e-9 * phase, (phase, pm.phase(costs))


# ---------------------------------------------------------------------------------------------- the report
def _fmt(xs, f="{:.2f}") -> str:
    return " ".join(f.format(x) for x in xs)


def report(title: str, preset: str, overrides: tuple, vs: tuple) -> None:
    from npu_train.metrics.mfu import spec_peak_flops, stage_flops_per_step
    from npu_train.planner import search

    t0 = time.perf_counter()
    req = request(preset, *overrides)
    pm = search._cost_model(req)
    L, P = req.model.num_layers, len(req.cards)
    split = [L // P + (1 if i < L % P else 0) for i in range(P)]
    sh = pm.shape
    tokens = sh.tokens_per_micro_batch * sh.micro_batches
    flops = sum(stage_flops_per_step(pm.model, n, i == P - 1, sh.seq_len, tokens, sh.active_adapter_params)
                for i, n in enumerate(split))
    peak = P * spec_peak_flops(pm.cards[0].kind, sh.dtype).flops
    print(f"\n== {title}: {preset} {' '.join(overrides)}")
    print(f"   micro-batch {sh.micro_batch} x {sh.micro_batches}, split {split}, model FLOPs {flops:.3g} a step, "
          f"peak {peak / 1e12:.0f} TFLOPS, card limit {pm.limit(0) / GiB:.2f} GiB")
    check_against_planner(pm, split)
    print("   v = 2 equals the planner (order, durations, recompute counts, memory, phase)")
    base = None
    for v in vs:
        if max(split) < v:
            print(f"   v={v}: n/a ({max(split)} layers a card)")
            continue
        r = price(pm, split, v, flops, peak)
        if not r["fits"]:
            print(f"   v={v}: fits on no card count of recomputed layers")
            continue
        base = base or r["step"]
        ideal = (P - 1) / (v * sh.micro_batches)
        print(f"   v={v}: step {r['step']:.2f} s ({base / r['step']:.3f}x v={vs[0]}), MFU {100 * r['mfu']:.1f} %, "
              f"phase {r['phase']:.2f} s, bubble card0 {r['bubble'][0]:.2f} s / max {max(r['bubble']):.2f} s "
              f"(ideal (P-1)/(vM) = {100 * ideal:.1f} % of the busy time), deadlock-free ({r['ticks']} unit ticks)")
        print(f"        recompute spread over the chunks by layers (the planner's timeline before the fix): "
              f"step {r['spread']:.2f} s, MFU {100 * r['mfu'] * r['step'] / r['spread']:.1f} %")
        print(f"        recomputed whole per card {r['k']}; recompute s {_fmt(r['rc'])}; copies s {_fmt(r['copies'])}")
        print(f"        memory GiB {_fmt([m / GiB for m in r['mem']])} "
              f"(activations {_fmt([a / GiB for a in r['act']])})")
        pure = [b - x - c for b, x, c in zip(r["busy"], r["rc"], r["copies"])]
        nb, nbr = max(r["busy"]) + r["side"], max(pure) + r["side"]
        even = sum(r["busy"]) / len(r["busy"]) + r["side"]
        print(f"        layer compute without recompute s {_fmt(pure)}; bounds: no bubble {nb:.2f} s = MFU "
              f"{100 * r['mfu'] * r['step'] / nb:.1f} %, no bubble and the work balanced over the cards {even:.2f} s "
              f"= MFU {100 * r['mfu'] * r['step'] / even:.1f} %, no bubble, recompute or copies {nbr:.2f} s = MFU "
              f"{100 * r['mfu'] * r['step'] / nbr:.1f} %; were no layer recomputed whole (memory ignored): step "
              f"{r['free']:.2f} s = MFU {100 * r['mfu'] * r['step'] / r['free']:.1f} %")
    print(f"   ({time.perf_counter() - t0:.1f} s)")


CASES = {
    "70b-lora": ("Llama-3.1-70B LoRA, 8 RNGD", "llama-3.1-70b",
                 ("train.mode=lora", "data.seq_len=2048", "train.recompute=true", "train.recompute_layers=fewest",
                  "train.recompute_attention=true", "train.schedule=interleaved")),
    "8b": ("Llama-3.1-8B full, 8 RNGD", "llama-3.1-8b",
           ("data.seq_len=2048", "train.recompute=true", "train.recompute_layers=fewest",
            "train.recompute_attention=true", "train.schedule=interleaved")),
}
SHAPES = (("train.micro_batch=1", "train.accum=32"), ("train.micro_batch=2", "train.accum=16"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--v", nargs="+", type=int, default=[1, 2, 4, 5])
    a = ap.parse_args()
    for name in a.cases:
        title, preset, ov = CASES[name]
        for shape in SHAPES:
            report(title, preset, ov + shape, tuple(a.v))


if __name__ == "__main__":
    main()
