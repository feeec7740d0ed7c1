"""Soak: a long CPU run with ``runtime.keep_host_memory`` true and false, RSS (anonymous + shared) of every
card process sampled from outside (experiments/bench/memwatch.py) and tagged with the step it ran in.

``python experiments/scripts/soak_rss.py --steps 1000 --out /tmp/soak`` makes a tiny random Llama with
transformers (``AutoModelForCausalLM.from_config`` + ``save_pretrained``, a BPE tokenizer trained on Botchan),
runs the launcher once per setting under memwatch and prints, per card, the per-step peak RSS summary
(window means, largest step-to-step rise, steps with a rise above ``--jump-mib``) as a Markdown table and
writes ``<out>/soak-<setting>.json`` (every step's peak, MiB) for the record (experiments/2026-12-03-soak.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MiB = 2 ** 20


def make_model(path: str) -> str:
    """A 6-layer hidden-64 Llama (tied embeddings) with its own 384-entry tokenizer, in HF layout."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    sys.path.insert(0, os.path.join(REPO, "src"))
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig

    from npu_train.data.text import botchan_text

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([botchan_text()], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(os.path.join(path, "tokenizer.json"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    return path


def run(model: str, out: str, steps: int, keep: bool, interval: float) -> dict:
    """One launch under memwatch; returns ``{card: {step: peak MiB}}`` and the wall time."""
    import time

    rd = os.path.join(out, f"run-keep-{str(keep).lower()}")
    subprocess.run(["rm", "-rf", rd], check=True)
    cmd = [sys.executable, os.path.join(REPO, "experiments", "bench", "memwatch.py"), "--run-dir", rd,
           "--interval", str(interval), "--", sys.executable, os.path.join(REPO, "launch", "run.py"),
           f"model.path={model}", "backend=cpu,cpu", "data.seq_len=32", "train.micro_batch=2", "train.accum=4",
           "train.lr=1e-3", "train.warmup_steps=1", "train.clip=0.5", "train.dtype=fp32", "runtime.threads=1",
           f"train.steps={steps}", "train.resident_layers=[1,2]", f"runtime.keep_host_memory={str(keep).lower()}",
           "checkpoint.save=false", f"hydra.run.dir={rd}"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode:
        raise SystemExit(f"run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    cards = {}
    for p in rec["processes"]:
        if not p["card"]:
            continue
        cards[p["card"]] = {int(k.split()[-1]): v / MiB for k, v in p["by_phase"].items() if k.startswith("after step")}
    return {"cards": cards, "wall_s": wall, "command": " ".join(cmd[cmd.index("--") + 1:])}


def summary(series: dict, jump_mib: float) -> list[str]:
    rows = []
    for card, by_step in sorted(series.items()):
        steps = sorted(by_step)
        v = [by_step[s] for s in steps]
        n = len(v)

        def mean(a, b):
            w = [by_step[s] for s in steps if a <= s <= b]
            return sum(w) / len(w) if w else float("nan")

        rises = [(steps[i], v[i] - v[i - 1]) for i in range(1, n)]
        big = [(s, d) for s, d in rises if d > jump_mib]
        top = max(rises, key=lambda t: t[1]) if rises else (0, 0.0)
        last = steps[-1] if steps else 0
        rows.append(f"| {card} | {n} | {mean(20, 40):.1f} | {mean(last // 2 - 10, last // 2 + 10):.1f} | "
                    f"{mean(last - 20, last):.1f} | {max(v):.1f} (step {steps[v.index(max(v))]}) | "
                    f"+{top[1]:.1f} at step {top[0]} | "
                    f"{len(big)}{': ' + ', '.join(f'{s} (+{d:.0f})' for s, d in big[:8]) if big else ''} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default="/tmp/npt-soak")
    ap.add_argument("--interval", type=float, default=0.01)
    ap.add_argument("--jump-mib", type=float, default=8.0)
    ap.add_argument("--model", default=None, help="model.path to soak instead of the tiny model (e.g. embedded)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = a.model or make_model(os.path.join(a.out, "model"))
    for keep in (True, False):
        res = run(model, a.out, a.steps, keep, a.interval)
        with open(os.path.join(a.out, f"soak-keep-{str(keep).lower()}.json"), "w") as f:
            json.dump(res, f)
        print(f"\n### runtime.keep_host_memory={str(keep).lower()} ({a.steps} steps, {res['wall_s']:.0f} s wall)\n")
        print(f"`{res['command']}`\n")
        print("| card | steps sampled | mean MiB steps 20-40 | mean MiB mid | mean MiB last 20 | max MiB | "
              f"largest step-to-step rise (MiB) | rises > {a.jump_mib:g} MiB |")
        print("|---|---:|---:|---:|---:|---:|---|---|")
        print("\n".join(summary(res["cards"], a.jump_mib)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
