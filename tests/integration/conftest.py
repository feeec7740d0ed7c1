"""Fixtures for multi-process integration tests: a tiny Llama in HF layout with its own tokenizer."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))

from npu_train.config import Config  # noqa: E402
from npu_train.env import cache_dir  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256)


#: per family: config.json keys beside TINY (Qwen3: head_dim 24 != 64 / 4; Mistral: a window = data.seq_len)
FAMILY_KEYS = {"llama": {}, "qwen2": {"use_sliding_window": False}, "qwen3": {"head_dim": 24},
               "mistral": {"sliding_window": 32},
               # mixture of experts: 8 experts, top-2, renormalised, layer 1 dense (config.json and LlamaConfig names)
               "qwen3_moe": {"head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                             "norm_topk_prob": True, "mlp_only_layers": [1]}}
#: FAMILY_KEYS that are config.json keys but not LlamaConfig fields
_JSON_ONLY = ("use_sliding_window",)


def make_tiny_model(path: str, *, tied: bool = True, vocab: int = 384, layers: int = 6, seed: int = 0,
                    family: str = "llama", **extra) -> str:
    """Write a tiny random model of ``family`` (config.json, model.safetensors, tokenizer.json trained on
    Botchan); biases ~ N(0, 0.1), norm gains ~ 1 + N(0, 0.1), routers ~ N(0, 0.5) (far from uniform).
    ``extra``: more config.json keys that are also LlamaConfig fields (``output_router_logits=True``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from npu_train.data.text import botchan_text
    from npu_train.model.config import FAMILIES, LlamaConfig

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([botchan_text()], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(os.path.join(path, "tokenizer.json"))
    v = tok.get_vocab_size()
    fam = FAMILIES[family]
    hf = dict(TINY, num_hidden_layers=layers, architectures=[fam.architecture], model_type=fam.model_type,
              vocab_size=v, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, hidden_act="silu")
    hf.update(FAMILY_KEYS[family])
    hf.update(extra)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    fields = {k: v for k, v in {**FAMILY_KEYS[family], **extra}.items() if k not in _JSON_ONLY}
    cfg = LlamaConfig(vocab_size=v, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=tied, family=family, **fields)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = dict(cfg.param_shapes(None))
    for i in range(layers):
        shapes.update(cfg.param_shapes(i))
    for n, s in shapes.items():
        if n.endswith(".bias"):
            tensors[n] = 0.1 * torch.randn(s, generator=g)
        elif n.endswith(".gate.weight"):  # a mixture-of-experts router
            tensors[n] = 0.5 * torch.randn(s, generator=g)
        else:
            tensors[n] = (torch.ones(s) + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else 0.08 * torch.randn(s, generator=g)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_tied")))


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_untied")), tied=False)


@pytest.fixture(scope="session", params=["qwen2", "qwen3", "mistral"])
def tiny_family_model(request, tmp_path_factory) -> str:
    """A tiny Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim 24) or Mistral (sliding_window 32) model, untied
    for Qwen3 (as Qwen3-8B), tied otherwise."""
    fam = request.param
    return make_tiny_model(str(tmp_path_factory.mktemp(f"tiny_{fam}")), family=fam, tied=fam != "qwen3")


def make_cfg(model_path: str, *overrides: str):
    """The launcher's config (structured defaults) with test-sized settings and dotlist overrides."""
    base = OmegaConf.structured(Config)
    test = OmegaConf.from_dotlist([
        f"model.path={model_path}", "data.seq_len=32", "train.steps=3", "train.micro_batch=2", "train.accum=4",
        "train.lr=1e-3", "train.warmup_steps=1", "train.clip=0.5", "train.dtype=fp32", "train.weight_decay=0.01",
        "runtime.heartbeat_timeout_s=20", "runtime.startup_timeout_s=120", "runtime.threads=1",
    ])
    cfg = OmegaConf.merge(base, test, OmegaConf.from_dotlist(list(overrides)))
    return cfg


def launcher_main():
    """``main(cfg, run_dir) -> exit status`` of ``launch/run.py`` (the entry point maps errors to exit codes)."""
    from scripts import LAUNCH_RUN, load_script

    return load_script(LAUNCH_RUN, "npt_launch_run").main


def run_pipeline(model_path: str, run_dir: str, *overrides: str, expect_rc: int = 0, keep_fitted: bool = False):
    """Run the real launcher in-process (card processes spawned); returns (losses, CheckpointReader|None):
    the losses of the steps this launch ran (a resumed launch's records also hold the run's earlier steps).

    Every run plans from the assumed figures: the figures an earlier run of the same test fitted
    (``$NPT_CACHE/fitted``) are dropped first unless ``keep_fitted``, since they may move the split
    chosen by ``auto`` and so the summation order two compared runs must share."""
    from npu_train.checkpoint.store import CheckpointReader, complete_checkpoints
    if not keep_fitted:
        shutil.rmtree(cache_dir("fitted"), ignore_errors=True)
    cfg = make_cfg(model_path, *overrides)
    rc = launcher_main()(cfg, run_dir)
    assert rc == expect_rc, f"launcher exit status {rc}, expected {expect_rc}"
    losses = []
    mpath = os.path.join(run_dir, "metrics.jsonl")
    try:  # a resumed launch's records start with the run's earlier steps (carried over): this launch's from here
        with open(os.path.join(run_dir, "summary.json")) as f:
            after = int(json.load(f).get("resumed_at_step") or 0)
    except (OSError, ValueError):
        after = 0
    if os.path.exists(mpath):
        with open(mpath) as f:
            losses = [r["loss"] for r in map(json.loads, filter(str.strip, f)) if int(r["step"]) > after]
    root = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    ck = complete_checkpoints(root)
    return losses, (CheckpointReader(ck[-1]) if ck else None)


def launch_to_end(tmp_path, model: str, *overrides: str, expect_rc: int = 0, timeout: float = 120.0, **job_kw):
    """Run ``launch/run.py`` as a subprocess (:class:`launch_util.Job`; ``job_kw``: ``env``, ``name``,
    ``backend``, ...) until it exits, within ``timeout`` seconds; whatever happens, every process it
    started is killed afterwards. Asserts the exit status is ``expect_rc`` (the job's output tail on
    failure) and returns the finished :class:`~launch_util.Job` (stdout, stderr, error lines, run dir)."""
    from launch_util import Job

    job = Job(tmp_path, model, *overrides, **job_kw)
    try:
        rc = job.wait(timeout)
    finally:
        job.kill_all()
    assert rc == expect_rc, f"launcher exit status {rc}, expected {expect_rc}\n{job.tail()}"
    return job


def reference_for(model_path: str, *overrides: str, aux_weight: float = 0.0):
    """Single-process reference with the same config (data, seed, schedule of LR) as ``make_cfg``
    (``aux_weight``: a mixture of experts' load-balancing loss weight)."""
    from npu_train.data.prepare import prepare_data
    from npu_train.model import load_config
    from reference import reference_run

    cfg = make_cfg(model_path, *overrides)
    t = cfg.train
    data = prepare_data(cfg, model_path, load_config(model_path))
    return reference_run(model_path, data, steps=t.steps, micro_batch=t.micro_batch, accum=t.accum, lr=t.lr,
                         warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, weight_decay=t.weight_decay,
                         clip=t.clip, seed=t.seed, betas=(t.beta1, t.beta2), eps=t.eps, aux_weight=aux_weight)


#: :func:`cached_reference`'s runs, by (model path, overrides): one single-process reference per shape a session
_REFERENCES: dict = {}


def cached_reference(model_path: str, *overrides: str):
    """:func:`reference_for` of ``model_path`` with ``overrides``, run once per session and argument list (the
    equivalence tests compare many pipelines with the same reference). ``(losses, {hf_name: fp32 weight})``."""
    key = (model_path,) + overrides
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_for(model_path, *overrides)
    return _REFERENCES[key]


def check_against_reference(losses, reader, ref_losses, ref_w, steps=3, loss_tol: float = 1e-6,
                            master_tol: float = 1e-5) -> None:
    """A pipeline run (``losses`` per step, checkpoint ``reader``) equals the reference: ``steps`` steps (None:
    as many as the reference), each loss within ``loss_tol`` relative, every fp32 master of the same shape as the
    reference's weight and within ``master_tol`` relative (:func:`rel_diff`)."""
    steps = len(ref_losses) if steps is None else steps
    assert len(losses) == steps and reader.step == steps, (len(losses), reader.step, steps)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < loss_tol, (losses, ref_losses)
    for name, w in ref_w.items():
        got = reader.get(f"master.{name}")
        assert tuple(got.shape) == tuple(w.shape), (name, tuple(got.shape), tuple(w.shape))
        assert rel_diff(got, w) < master_tol, f"{name}: rel diff {rel_diff(got, w):.2e}"


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def peft_lora_model(model_path: str, lora, seed: int, dtype=torch.float32):
    """``(model, {hf_name.lora_A/B.weight: parameter})``: transformers' model of ``model_path`` wrapped by
    ``peft.get_peft_model`` with ``lora``'s rank / alpha / targets (dropout 0, ``bias="none"``), in ``dtype``, its
    adapters set to the trainer's initial values (``init_adapter``: A random, B = 0), as a user would load a shared
    initialisation."""
    import peft
    from transformers import AutoModelForCausalLM

    from npu_train.model.lora import init_adapter

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)  # the family's class
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                      target_modules=list(lora.targets), bias="none"))
    model.to(dtype)
    adapters = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
                hf = name.replace("base_model.model.", "", 1)
                a, b = init_adapter(f"{hf}.weight", tuple(mod.lora_A["default"].weight.shape),
                                    tuple(mod.lora_B["default"].weight.shape), seed)
                mod.lora_A["default"].weight.copy_(a)
                mod.lora_B["default"].weight.copy_(b)
                adapters[f"{hf}.lora_A.weight"] = mod.lora_A["default"].weight
                adapters[f"{hf}.lora_B.weight"] = mod.lora_B["default"].weight
    return model, adapters
