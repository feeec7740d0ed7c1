"""Loss curves of the model-families runs: ``python experiments/scripts/model_families_curves.py <runs dir> <png>``
reads ``<runs dir>/<family>-<hf|gguf>/metrics.jsonl``, prints a markdown table (loss every 5 steps, final val loss)
and draws all curves into ``<png>``."""
from __future__ import annotations

import json
import os
import sys


def main(runs: str, png: str) -> None:
    curves = {}
    for name in sorted(os.listdir(runs)):
        m = os.path.join(runs, name, "metrics.jsonl")
        if os.path.isfile(m):
            with open(m) as f:
                curves[name] = [json.loads(line)["loss"] for line in f if line.strip()]
    evals = {}
    for name in curves:
        e = os.path.join(runs, name, "eval.jsonl")
        if os.path.isfile(e):
            with open(e) as f:
                evals[name] = [json.loads(line)["val_loss"] for line in f if line.strip()][-1]
    steps = [1] + list(range(5, max(len(c) for c in curves.values()) + 1, 5))
    print("| step | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{c[s - 1]:.4f}" if s <= len(c) else "" for c in curves.values()) + " |")
    print("| val (end) | " + " | ".join(f"{evals[n]:.4f}" if n in evals else "" for n in curves) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=name, linestyle="--" if name.endswith("gguf") else "-")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("tiny random models per family, 2 CPU cards")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
