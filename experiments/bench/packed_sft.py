"""Packed vs padded chat SFT (issue 25): assistant (target) tokens per second of the real launcher on
``botchan-chat``, ``data.pack=true`` against ``data.pack=false`` (the baseline) at the same ``data.seq_len``.

Each run: ``launch/run.py data.format=chat data.source=botchan-chat data.seq_len=S data.pack=X
train.steps=N backend=[cpu,cpu] runtime.threads=1 data.eval_batches=0 checkpoint.save=false`` as a
subprocess (default model: the shipped SmolLM2-135M-Instruct, full fine-tuning, fp32; ``--small``: a random
4-layer Llama of hidden size 256 with SmolLM2's vocabulary, tokenizer and chat template,
``model.tokenizer=embedded``, for a loaded machine: the packing gain is a property of the rows, and a
small model gives attention, where the mask costs, a larger share of the step). Per run: the
target tokens of steps 2..N (``tokens`` in ``metrics.jsonl``: for chat data the assistant tokens, the
same count the loss is divided by) over their summed ``step_s`` (step 1 excluded: start-up), and the
mean step time. Rounds interleave the two variants (order rotated each round); medians over rounds and
the packed/padded ratio of the medians, plus the ratio within each round. The 1-minute load average
before and after every run is printed (the dev machine is shared: read the spread with it).

    /work/main/.venv/bin/python experiments/bench/packed_sft.py --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, print_machine, spread, write_json  # noqa: E402

VARIANTS = {"padded": "data.pack=false", "packed": "data.pack=true"}


def small_model(out: Path) -> str:
    """A random Llama (4 layers, hidden 256, 4 heads / 2 kv heads, SmolLM2's 49152-entry vocabulary, tied,
    eos = <|im_end|> = 2 as SmolLM2-Instruct) as an HF directory without a tokenizer (see --small)."""
    import torch
    from safetensors.torch import save_file

    from npu_train.model.config import LlamaConfig

    V, H, I, L = 49152, 256, 768, 4
    out.mkdir(parents=True, exist_ok=True)
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=I,
              num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
              rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, hidden_act="silu")
    (out / "config.json").write_text(json.dumps(hf))
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=L, num_heads=4, num_kv_heads=2,
                      tie_word_embeddings=True)
    shapes = dict(cfg.param_shapes(None))
    for i in range(L):
        shapes.update(cfg.param_shapes(i))
    g = torch.Generator().manual_seed(0)
    t = {n: torch.ones(s) if len(s) == 1 else 0.02 * torch.randn(s, generator=g) for n, s in shapes.items()}
    t.pop("lm_head.weight", None)
    save_file(t, str(out / "model.safetensors"))
    return str(out)


def run_one(variant: str, a, out_dir: Path) -> dict:
    run_dir = out_dir / f"{variant}-{time.time_ns()}"
    cmd = [sys.executable, str(ROOT / "launch/run.py"), "data.format=chat", "data.source=botchan-chat",
           f"data.seq_len={a.seq_len}", VARIANTS[variant], f"train.steps={a.steps}",
           f"train.micro_batch={a.micro_batch}", f"train.accum={a.accum}", "backend=[cpu,cpu]",
           "runtime.threads=1", "train.dtype=fp32", "data.eval_batches=0", "checkpoint.save=false",
           f"hydra.run.dir={run_dir}"] + list(a.model_args) + list(a.extra)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(out_dir / f"{run_dir.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{variant}: launcher exit status {rc}; see {out_dir / (run_dir.name + '.log')}")
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if l.strip()]
    later = [r for r in recs if r["step"] >= 2]
    toks, secs = sum(r["tokens"] for r in later), sum(r["step_s"] for r in later)
    return {"variant": variant, "tokens_per_s": toks / secs, "step_s": secs / len(later),
            "tokens_per_step": toks / len(later), "losses": [r["loss"] for r in recs], "wall_s": wall,
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="one round, 3 steps (a smoke run, not a result)")
    ap.add_argument("--small", action="store_true", help="a small random model with SmolLM2's tokenizer (see above)")
    ap.add_argument("extra", nargs="*", help="more launcher overrides for both variants")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps = 1, 3
    info = machine_info()
    print_machine(info)
    print(f"botchan-chat, data.seq_len={a.seq_len}, micro_batch={a.micro_batch}, accum={a.accum}, "
          f"steps={a.steps} (steps 2..{a.steps} measured), 2 cpu cards, fp32, "
          f"model {'small random (--small)' if a.small else 'embedded SmolLM2-135M'}", flush=True)
    runs = []
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="npt-packed-bench-") as tmp:
        a.model_args = ([f"model.path={small_model(Path(tmp) / 'small')}", "model.tokenizer=embedded"]
                        if a.small else [])
        for k in range(a.rounds):
            order = names[k % 2:] + names[:k % 2]
            for v in order:
                r = run_one(v, a, Path(tmp))
                r["round"] = k
                runs.append(r)
                print(f"round {k} {v:6s}: {r['tokens_per_s']:8.1f} assistant tok/s, {r['step_s']:.2f} s/step, "
                      f"{r['tokens_per_step']:.0f} tok/step, load {r['load_before']} -> {r['load_after']}",
                      flush=True)
    summ = {v: spread([r["tokens_per_s"] for r in runs if r["variant"] == v]) for v in names}
    per_round = [next(r for r in runs if r["round"] == k and r["variant"] == "packed")["tokens_per_s"]
                 / next(r for r in runs if r["round"] == k and r["variant"] == "padded")["tokens_per_s"]
                 for k in range(a.rounds)]
    ratio = summ["packed"]["median"] / summ["padded"]["median"]
    for v in names:
        s = summ[v]
        print(f"{v:6s}: median {s['median']:.1f} assistant tok/s [{s['min']:.1f}-{s['max']:.1f}] over {s['n']} rounds")
    print(f"packed / padded (medians): {ratio:.2f}x; per round: {', '.join(f'{x:.2f}' for x in per_round)}")
    write_json(a.json, {"machine": info, "args": {k: v for k, v in vars(a).items() if k != "model_args"}, "runs": runs, "summary": summ, "ratio": ratio,
                        "ratio_per_round": per_round})


if __name__ == "__main__":
    main()
