"""Does botchan-prefs teach a DPO signal to SmolLM2-135M quickly? A data-side probe, not the product's DPO.

Builds ``data.source=botchan-prefs`` with :func:`npu_train.data.preference.build_preference_data` (seq_len 128),
loads the embedded SmolLM2-135M-Instruct GGUF with transformers (fp32, CPU), and runs plain full fine-tuning
with the DPO sigmoid loss written from the paper (Rafailov et al. 2023, eq. 7):
``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``, ``pi_*`` / ``ref_*`` the summed log-probabilities
of the completion tokens (labels != -100) under the policy / the frozen initial model. Prints per step the
loss, reward accuracy (chosen reward > rejected reward) and margin, and the same on the held-out pairs
before and after.

Usage: PYTHONPATH=src python experiments/archive/dpo_prefs_probe.py [steps] [pairs_per_step] [lr]
(each step's pairs are new to the policy, so its accuracy before the update is already a held-out figure)
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from npu_train.data.chat import ChatRenderer
from npu_train.data.dataset import micro_batch_tensors
from npu_train.data.preference import build_preference_data
from npu_train.model import chat_template, embedded_model_path, load_config, load_tokenizer, special_tokens

BETA = 0.1
#: held-out pairs scored before and after (CPU time)
EVAL_PAIRS = 12


def logps(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probabilities ``[B]`` of the targets ``y`` (IGNORE -100 skipped) given inputs ``x``."""
    n = int((x != 2).sum(1).max()) + 1  # trim the common padding tail (pad = EOS = 2 after the completion)
    n = min(max(n, int((y != -100).nonzero()[:, 1].max()) + 1), x.shape[1])
    logits = model(input_ids=x[:, :n]).logits.float()
    yy = y[:, :n]
    lp = torch.gather(F.log_softmax(logits, -1), 2, yy.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (lp * (yy != -100)).sum(1)


def dpo(pol, ref, x, y):
    """(loss, accuracy, margin) of the pairs in rows (2i, 2i+1)."""
    pc, pr = pol[0::2], pol[1::2]
    rc, rr = ref[0::2], ref[1::2]
    chosen, rejected = BETA * (pc - rc), BETA * (pr - rr)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, (chosen > rejected).float().mean().item(), (chosen - rejected).mean().item()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    per_step = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    lr = float(sys.argv[3]) if len(sys.argv) > 3 else 5e-6
    torch.manual_seed(0)
    torch.set_num_threads(2)
    path = embedded_model_path()
    tok, cfg = load_tokenizer(path), load_config(path)
    r = ChatRenderer(tok, chat_template(path), eos_id=cfg.eos_token_id, **special_tokens(path))
    d = build_preference_data("botchan-prefs", r, 128, 0.05, pad_id=cfg.eos_token_id)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  torch_dtype=torch.float32)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)

    def evaluate(tag):
        x, y = micro_batch_tensors(d, torch.arange(min(d.n_val, 2 * EVAL_PAIRS)), "val")
        with torch.no_grad():
            loss, acc, margin = dpo(logps(policy, x, y), logps(reference, x, y), x, y)
        print(f"{tag}: val pairs {x.shape[0] // 2} loss {loss.item():.4f} (ln 2 = {math.log(2):.4f}) "
              f"accuracy {acc:.2f} margin {margin:.3f}", flush=True)

    evaluate("before")
    order = torch.randperm(d.n_train // 2)
    t0 = time.time()
    for step in range(steps):
        pairs = order[(step * per_step) % len(order):][:per_step]
        idx = torch.stack([2 * pairs, 2 * pairs + 1], 1).reshape(-1)
        x, y = micro_batch_tensors(d, idx)
        with torch.no_grad():
            ref = logps(reference, x, y)
        loss, acc, margin = dpo(logps(policy, x, y), ref, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step + 1:3d} loss {loss.item():.4f} rewards/accuracy {acc:.2f} rewards/margin {margin:.3f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    evaluate("after")


if __name__ == "__main__":
    main()
