"""DPO pairs tokenized as TRL 1.16's ``DPOTrainer`` does (issue 40), offline, for the three preference formats
(standard strings, conversations, implicit prompts) on three tokenizer kinds: a SentencePiece-style one
(``Metaspace`` pre-tokenizer, adds a BOS, a Mistral-like template; trained here on a few rows), the shipped
SmolLM2's byte-level BPE (no BOS), and the same with a post-processor that adds a BOS (as Llama 3's).

The expected ids come from TRL itself: ``DPOTrainer._prepare_dataset`` (prompt extraction, EOS added to string
completions, prompt and prompt + completion tokenized together and cut where they diverge) run on a
``datasets.Dataset`` of the rows with ``AutoTokenizer.from_pretrained`` of a directory holding the tokenizer,
its template and special tokens; no model and no trainer are built (the method reads only ``_tokenizer``).
The project's side reads the same directory as ``prepare_data`` does."""
from __future__ import annotations

import json
from importlib import resources
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("jinja2")

from npu_train.data.prepare import build_preference_data  # noqa: E402
from npu_train.data.render import ChatRenderer, pair_tokens  # noqa: E402
from npu_train.data.rows import row_pair  # noqa: E402

#: Mistral-style: the answer follows "[/INST]" with no space, so its first word has no word-start marker in the
#: whole text ('The') while on its own the Metaspace pre-tokenizer gives it one ('▁The'): issue 40's case
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
                    "{% elif m['role'] == 'system' %}<<SYS>> {{ m['content'] }} <</SYS>> "
                    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
KINDS = ("metaspace", "bytelevel", "bos")


def _prefs(n: int = 8) -> list[dict]:
    path = resources.files("npu_train.data").joinpath("assets", "botchan_prefs.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()[:n]]


def _edge_strings(eos: str) -> list[dict]:
    """Prompts ending in a space or mid-word (byte-level BPE merges across the cut), a completion that already
    ends with the EOS text (TRL adds none), one starting with a space."""
    return [{"prompt": "The capital of France is ", "chosen": "Paris.", "rejected": "Rome."},
            {"prompt": "The capital of France is Par", "chosen": "is.", "rejected": "ma."},
            {"prompt": "Answer: ", "chosen": "Yes." + eos, "rejected": "No."},
            {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}]


def _rows(kind: str, eos: str) -> dict[str, list[dict]]:
    """The rows of each format (TRL's dataset formats), per sub-case."""
    conv = _prefs()
    conv.append({"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi."},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}],
                 "chosen": [{"role": "assistant", "content": "Hello again."}],
                 "rejected": [{"role": "assistant", "content": "no"}]})
    strings = [{k: r[k][0]["content"] for k in ("prompt", "chosen", "rejected")} for r in _prefs()]
    strings += _edge_strings(eos)
    implicit = [{"chosen": s["prompt"] + " " + s["chosen"], "rejected": s["prompt"] + " " + s["rejected"]}
                for s in strings[:8]]
    implicit += [{"chosen": "The cat sat on the mat.", "rejected": "The cat sat on the hat."}]
    implicit_conv = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in conv]
    return {"standard": strings, "conversational": conv, "implicit": implicit, "implicit-conversational": implicit_conv}


def _metaspace(d) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = [m["content"] for r in _prefs(40) for k in ("prompt", "chosen", "rejected") for m in r[k]]
    corpus += ["[INST] [/INST] <<SYS>> <</SYS>> The capital of France is Paris Rome Par ma Answer: Yes No The sky is "
               "blue green cat sat on the mat hat Hi Hello again Again no briefly"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(d / "tokenizer.json"))
    return {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": MISTRAL_TEMPLATE}


def _make(kind: str, d) -> dict:
    """Write the tokenizer directory of ``kind`` into ``d``; its tokenizer_config.json entries."""
    from tokenizers import Tokenizer, processors

    from npu_train.model import chat_template, embedded_model_path, load_tokenizer, special_tokens

    try:
        smol = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok, template = load_tokenizer(smol), chat_template(smol)
    cfg = dict(special_tokens(smol), chat_template=template)
    if kind == "metaspace":
        cfg = _metaspace(d)
    elif kind == "bos":
        tok = Tokenizer.from_str(tok.to_str())
        bos = "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
        cfg = dict(cfg, bos_token=bos, chat_template="{{ bos_token }}" + template)
    if kind != "metaspace":
        tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, tokenizer_class="PreTrainedTokenizerFast")))
    return cfg


_BUILT: dict = {}


def _kind(name: str, tmp_path_factory) -> dict:
    """``{"name", "hf" (TRL's processing class), "renderer" (the project's, as prepare_data builds it), "eos"}``,
    built once per kind."""
    from transformers import AutoTokenizer

    from npu_train.model import chat_template, load_tokenizer, special_tokens

    if name not in _BUILT:
        d = tmp_path_factory.mktemp(name)
        cfg = _make(name, d)
        tok = load_tokenizer(str(d))
        renderer = ChatRenderer(tok, chat_template(str(d)), eos_id=tok.token_to_id(cfg["eos_token"]),
                                **special_tokens(str(d)))
        _BUILT[name] = {"name": name, "hf": AutoTokenizer.from_pretrained(str(d)), "renderer": renderer,
                        "eos": cfg["eos_token"]}
    return _BUILT[name]


@pytest.fixture(scope="module", params=KINDS)
def kind(request, tmp_path_factory):
    return _kind(request.param, tmp_path_factory)


def _trl(hf, rows: list[dict]) -> list[tuple[list, list, list]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` per row from TRL 1.16's ``DPOTrainer._prepare_dataset``."""
    import datasets
    from trl.trainer.dpo_trainer import DPOTrainer

    datasets.disable_progress_bars()
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    out = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=hf), datasets.Dataset.from_list(rows), hf, args,
                                      "train")
    return [(list(r["prompt_ids"]), list(r["chosen_ids"]), list(r["rejected_ids"])) for r in out]


def _ours(renderer, rows: list[dict]) -> list[tuple[list, list, list]]:
    out = []
    for i, r in enumerate(rows):
        t = pair_tokens(renderer, row_pair(r, "prompt" in r, f"row {i}"))
        out.append((t.prompt, t.chosen, t.rejected))
    return out


@pytest.mark.parametrize("fmt", ["standard", "conversational", "implicit", "implicit-conversational"])
def test_pairs_are_tokenized_as_trl_dpo_trainer_does(kind, fmt):
    rows = _rows(kind["name"], kind["eos"])[fmt]
    want, got = _trl(kind["hf"], rows), _ours(kind["renderer"], rows)
    tokens = kind["hf"].convert_ids_to_tokens
    for i, (w, g) in enumerate(zip(want, got)):
        assert g == w, (f"{kind['name']} {fmt} row {i}: prompt ends {tokens(g[0][-3:])} / TRL {tokens(w[0][-3:])}; "
                        f"chosen starts {tokens(g[1][:3])} / TRL {tokens(w[1][:3])}")
    assert len(got) == len(rows)


def test_the_metaspace_completion_starts_as_in_the_joint_text(tmp_path_factory):
    """Issue 40's case: a completion tokenized on its own would start with a word-start marker ('▁The');
    tokenized after its prompt it continues the text, as the model sees it at inference."""
    kind = _kind("metaspace", tmp_path_factory)
    row = {"prompt": "Continue the story:", "chosen": "The master laughed.", "rejected": "Laughed the master."}
    (p, c, _), = _ours(kind["renderer"], [row])
    alone = kind["renderer"].tok.encode(row["chosen"], add_special_tokens=False).ids
    assert kind["hf"].convert_ids_to_tokens(alone[:1])[0].startswith("\u2581")
    assert not kind["hf"].convert_ids_to_tokens(c[:1])[0].startswith("\u2581")
    assert c != alone + [kind["renderer"].tok.token_to_id("</s>")]
    assert p[0] == kind["renderer"].tok.token_to_id("<s>")  # the BOS the tokenizer adds, as TRL's call adds it


def test_the_built_rows_hold_trls_ids(kind, tmp_path):
    """End to end through the pack stage: row 2i = TRL's prompt + chosen ids, 2i + 1 = prompt + rejected,
    labels on the completion only."""
    rows = _rows(kind["name"], kind["eos"])["standard"]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = build_preference_data(str(src), kind["renderer"], 256, 0.0, pad_id=0, log=lambda m: None)
    for i, (p, c, r) in enumerate(_trl(kind["hf"], rows)):
        for k, comp in ((2 * i, c), (2 * i + 1, r)):
            ids, mask = d.train[k].to(torch.int64).tolist(), d.train_labels[k].tolist()
            n = len(p) + len(comp)
            assert ids[:n] == p + comp and mask[:n] == [0] * len(p) + [1] * len(comp) and not any(mask[n:])
