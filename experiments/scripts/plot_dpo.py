"""Plot DPO runs: loss, reward accuracy and margin per step from each run dir's metrics.jsonl (and eval.jsonl).

    python experiments/scripts/plot_dpo.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]
"""
from __future__ import annotations

import json
import math
import os
import sys


def _read(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main(argv: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = argv[0], [a.split("=", 1) for a in argv[1:]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for label, d in runs:
        m, ev = _read(os.path.join(d, "metrics.jsonl")), _read(os.path.join(d, "eval.jsonl"))
        s = [r["step"] for r in m]
        axes[0].plot(s, [r["loss"] for r in m], label=f"{label} train")
        if ev:
            axes[0].plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o--", label=f"{label} val")
        axes[1].plot(s, [r["rewards/accuracies"] for r in m], label=label)
        axes[2].plot(s, [r["rewards/margins"] for r in m], label=label)
    axes[0].axhline(math.log(2), color="grey", lw=0.8, ls=":", label="ln 2")
    for ax, t in zip(axes, ("DPO loss (nats / pair)", "rewards/accuracies", "rewards/margins (nats)")):
        ax.set_title(t)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
