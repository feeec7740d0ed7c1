"""The project's DPO / IPO loss against TRL's ``DPOTrainer`` on the same batch (a second, independent implementation;
tests/unit/test_dpo.py checks the formulas from the papers).

TRL side: a real ``trl.DPOTrainer`` (trl >= 1.16) around a tiny random ``LlamaForCausalLM`` (fp32, CPU) and a word-level
tokenizer built here, ``precompute_ref_log_probs=True`` (so the reference log-probabilities are inputs of the batch,
``ref_chosen_logps`` / ``ref_rejected_logps``, and no reference model is loaded). The batch is made by the trainer's own
collator (``DataCollatorForPreference``: rows ``[chosen_0..chosen_{k-1}, rejected_0..rejected_{k-1}]``, right padding,
``completion_mask``), and the loss is ``trainer.compute_loss(model, batch)``: TRL's fused LM head (per-token
log-probabilities in chunks, the CPU path that scores every position) and its ``_compute_loss``, which also appends the
step's metrics to ``trainer._metrics["train"]``.

Project side: the same model's logits (the unpatched forward, ``fused_lm_head=False``) of the same ``input_ids`` /
``attention_mask``, rows reordered to pairs ``[chosen_0, rejected_0, chosen_1, ...]``, shifted labels ``labels[b, t] =
input_ids[b, t + 1]`` where ``completion_mask[b, t + 1] == 1`` else -100, the same reference values (fp32 values, passed
as float64), into ``DpoObjective.loss_sum``; ``loss_sum / k`` against TRL's loss (the mean over pairs).

Tolerance: 1e-6 on the loss, relative where it is above 1 (both sides are fp32, one ulp of IPO's ~38 at beta 0.1 is
3.8e-6; measured: 0 to 1 ulp), 1e-5 on the metrics (means of summed log-probabilities of ~20 nats).
The reward metrics follow TRL's for every loss: ``beta * (summed log-ratio)``, also for IPO (whose loss uses per-token
averages).
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from npu_train.model.dpo import DpoSettings  # noqa: E402
from npu_train.pipeline.objective import DpoObjective, PairTargets  # noqa: E402

N_WORDS = 40
#: (prompt words, chosen words, rejected words) of each pair: different prompt and completion lengths, so the
#: collator pads and the per-token averages of IPO differ between rows
PAIRS = [(3, 4, 2), (5, 1, 3), (2, 3, 3), (4, 2, 5)]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


class _Host:
    """The backend's only use in ``loss_sum``: ``upload`` (identity on CPU)."""

    def upload(self, t):
        return t


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(N_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=N_WORDS + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # a wider spread of log-probabilities than the default init's near-uniform head
        model.lm_head.weight.mul_(20.0)
    return model


def _trainer(tmp_path, beta: float, loss: str):
    from trl import DPOConfig, DPOTrainer

    ds = datasets.Dataset.from_dict({"prompt": ["w1 w2"], "chosen": [" w3"], "rejected": [" w4"]})
    args = DPOConfig(output_dir=str(tmp_path / "out"), beta=beta, loss_type=[loss], precompute_ref_log_probs=True,
                     report_to=[], use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=len(PAIRS),
                     save_strategy="no", seed=0, dataloader_num_workers=0)
    return DPOTrainer(model=_model(), args=args, train_dataset=ds, processing_class=_tokenizer())


def _examples():
    """Token-id examples for the trainer's collator, with reference log-probabilities (fp32 values) near the policy's
    (about -6.3 nats per completion token for this model), so the rewards have both signs."""
    g = torch.Generator().manual_seed(4)  # 2 of the 4 pairs have the larger reward on the chosen row
    out = []
    for p, c, r in PAIRS:
        ids = (torch.randint(2, N_WORDS + 2, (p + c + r,), generator=g)).tolist()
        ref = torch.randn(2, generator=g) * 4.0 - 6.3 * torch.tensor([c + 1, r + 1], dtype=torch.float32)
        out.append({"prompt_ids": ids[:p], "chosen_ids": ids[p:p + c] + [1], "rejected_ids": ids[p + c:] + [1],
                    "ref_chosen_logps": float(ref[0]), "ref_rejected_logps": float(ref[1])})
    return out


def _project(model, batch, settings: DpoSettings):
    """``(loss_sum / k, DpoObjective.metrics)`` of the project on TRL's collated ``batch``."""
    k = batch["input_ids"].shape[0] // 2
    order = torch.tensor([i // 2 + (i % 2) * k for i in range(2 * k)])  # [c0, r0, c1, r1, ...] from [c..., r...]
    ids, att, comp = (batch[n][order] for n in ("input_ids", "attention_mask", "completion_mask"))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(comp[:, 1:] == 1, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    ref = torch.stack([batch["ref_chosen_logps"], batch["ref_rejected_logps"]], dim=1).reshape(-1).double()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    obj = DpoObjective(settings)
    loss_sum, stats = obj.loss_sum(logits, PairTargets(labels=labels, ref=ref), _Host(), fused=False)
    return float(loss_sum) / k, obj.metrics(stats, k)


def _both(tmp_path, beta, loss):
    trainer = _trainer(tmp_path, beta, loss)
    model = trainer.model
    model.train()
    batch = trainer.data_collator(_examples())
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(model, batch))
    trl_metrics = {m: trainer._metrics["train"][m][-1] for m in METRICS}
    ours, our_metrics = _project(model, batch, DpoSettings(beta=beta, loss=loss))
    return trl_loss, ours, trl_metrics, our_metrics


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_equals_trl_dpo_trainer(tmp_path, monkeypatch, loss, beta):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    trl_loss, ours, trl_m, our_m = _both(tmp_path, beta, loss)
    assert abs(ours - trl_loss) <= 1e-6 * max(1.0, abs(trl_loss)), (loss, beta, ours, trl_loss)
    assert trl_loss > 1e-3  # not a degenerate batch
    for m in ("logps/chosen", "logps/rejected"):
        assert abs(our_m[m] - trl_m[m]) < 1e-5, (m, our_m[m], trl_m[m])
    if loss == "sigmoid":
        assert 0.0 < trl_m["rewards/accuracies"] < 1.0  # rewards of both signs: the metrics tell rows apart
        for m in METRICS:
            assert abs(our_m[m] - trl_m[m]) < 1e-5, (m, our_m[m], trl_m[m])


def test_ipo_reward_metrics_equal_trl(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    _, _, trl_m, our_m = _both(tmp_path, 0.1, "ipo")
    for m in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(our_m[m] - trl_m[m]) < 1e-5, (m, our_m[m], trl_m[m])
