"""Chat / prompt-completion data: assistant-only labels, padding, truncation, row errors."""
from __future__ import annotations

import json

import pytest
import torch

from npu_train.data import DataError
from npu_train.data.chat import ChatRenderer
from npu_train.data.dataset import load_packed, micro_batch_tensors, save_packed
from npu_train.data.sft import build_sft_data
from npu_train.model.llama import IGNORE_INDEX, causal_lm_loss_sum

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def smol():
    from npu_train.model import chat_template, embedded_model_path, load_config, load_tokenizer, special_tokens

    try:
        path = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = load_config(path)
    tok = load_tokenizer(path)
    return {"path": path, "cfg": cfg, "tok": tok, "template": chat_template(path),
            "specials": special_tokens(path)}


def _renderer(smol, template=None):
    return ChatRenderer(smol["tok"], template if template is not None else smol["template"],
                        eos_id=smol["cfg"].eos_token_id, **smol["specials"])


def _trained_spans(tok, labels: list[int]) -> list[str]:
    """Decode each maximal run of trained positions (labels != IGNORE_INDEX)."""
    spans, cur = [], []
    for x in labels + [IGNORE_INDEX]:
        if x != IGNORE_INDEX:
            cur.append(x)
        elif cur:
            spans.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    return spans


TWO_TURNS = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "It is 42."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "Doubled, it's 84."},
]
THREE_TURNS = [{"role": "system", "content": "You answer briefly."}] + TWO_TURNS + [
    {"role": "user", "content": "Thanks! Say bye."},
    {"role": "assistant", "content": "Bye 👋"},
]


@pytest.mark.parametrize("msgs", [TWO_TURNS, THREE_TURNS], ids=["2-turn", "3-turn"])
def test_only_assistant_content_and_eot_trained(smol, msgs):
    s = _renderer(smol).sample(msgs, "t.jsonl:1", "chat")
    want = [m["content"] + EOT for m in msgs if m["role"] == "assistant"]
    assert _trained_spans(smol["tok"], s.labels) == want
    # the rest (system prompt, user turns, role headers) is masked and the ids are the whole rendering
    text = smol["tok"].decode(s.ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\n" in text and "You are" in text or "You answer briefly." in text
    n_trained = sum(x != IGNORE_INDEX for x in s.labels)
    assert 0 < n_trained < len(s.ids)


def test_prompt_completion_row(smol):
    from npu_train.data.chat import row_messages

    msgs = row_messages({"prompt": "Name a colour.", "completion": "Blue."}, "prompt_completion", "f:1")
    s = _renderer(smol).sample(msgs, "f:1", "prompt_completion")
    assert _trained_spans(smol["tok"], s.labels) == ["Blue." + EOT]


def test_prompt_completion_without_template(smol):
    r = ChatRenderer(smol["tok"], None, eos_id=2)
    s = r.sample([{"role": "user", "content": "Say hi:"}, {"role": "assistant", "content": " hi"}], "f:1",
                 "prompt_completion")
    assert _trained_spans(smol["tok"], s.labels) == [" hi" + EOT]
    with pytest.raises(DataError, match="no chat template"):
        r.sample(TWO_TURNS, "f:2", "chat")


# a stock-style template without {% generation %} markers that trims content and has a BOS
_NO_MARKERS = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same with generation markers (transformers' return_assistant_tokens_mask path)
_MARKERS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen2.5-Instruct's template (tools branch left out): ChatML, a default system prompt, no generation markers
_QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
           "'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
           "helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == "
           "'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not "
           "message.tool_calls) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
           "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
# Qwen3's template (tools and reasoning_content left out): the answer after the last user message gets an
# empty <think> block only when it is the last message, so turn-by-turn prefixes do not match the full text
_QWEN3 = ("{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
          "{%- endif %}{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
          "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
          "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set ns.multi_step_tool = false %}"
          "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
          "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not "
          "loop.first) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
          "{%- elif message.role == 'assistant' %}{%- if loop.index0 > ns.last_query_index and loop.last %}"
          "{{- '<|im_start|>' + message.role + '\n<think>\n\n</think>\n\n' + message.content.lstrip('\n') }}"
          "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content }}{%- endif %}"
          "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
          "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}")


@pytest.mark.parametrize("template", [_NO_MARKERS, _MARKERS, _QWEN25, _QWEN3],
                         ids=["no-markers", "generation-markers", "qwen2.5", "qwen3"])
def test_other_templates(smol, template):
    r = _renderer(smol, template)
    assert r.has_generation_markers == ("{% generation %}" in template)
    msgs = [dict(m) for m in TWO_TURNS]
    if template is _NO_MARKERS:
        msgs[1]["content"] = "  It is 42.  "  # trimmed by the template: still found
    s = r.sample(msgs, "t:1", "chat")
    assert _trained_spans(smol["tok"], s.labels) == ["It is 42." + EOT, "Doubled, it's 84." + EOT]
    if template is _QWEN3:  # the empty think block before the final answer is not trained
        assert "<think>\n\n</think>\n\nDoubled" in smol["tok"].decode(s.ids, skip_special_tokens=False)


def test_template_hiding_the_answer_is_an_error(smol):
    hides = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n<|im_end|>\n{% endfor %}"
    with pytest.raises(DataError, match=r"t.jsonl:7: .*does not appear verbatim"):
        _renderer(smol, hides).sample(TWO_TURNS, "t.jsonl:7", "chat")


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(p)


def test_padding_labels_and_roundtrip(smol, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}."}]}
            for i in range(4)]
    logs = []
    d = build_sft_data(_write(tmp_path, rows), "chat", _renderer(smol), seq_len=64, val_fraction=0.25,
                       pad_id=2, log=logs.append)
    assert d.n_train == 3 and d.n_val == 1 and d.train.shape == (3, 65) and d.train_labels.shape == (3, 65)
    assert "4 of 4 chat samples kept" in logs[0]
    x, y = micro_batch_tensors(d, torch.tensor([1, 0]))
    assert x.shape == y.shape == (2, 64)
    for b, row in enumerate((1, 0)):
        lab = d.train_labels[row]
        assert torch.equal(y[b], lab[1:]) and torch.equal(x[b], d.train[row, :-1])
        toks = d.train[row].tolist()
        n_pad = len(toks) - len("".join("p" if t == 2 else "x" for t in toks).rstrip("p"))  # trailing pad run
        assert n_pad > 0 and (lab[len(toks) - n_pad:] == IGNORE_INDEX).all()  # padding is never a target
        assert _trained_spans(smol["tok"], lab.tolist()) == [f"A{row}.{EOT}"]
    p = save_packed(d, tmp_path / "c.safetensors")
    d2 = load_packed(p)
    assert torch.equal(d2.train_labels, d.train_labels) and torch.equal(d2.val_labels, d.val_labels)
    # an all-masked micro-batch contributes 0, not NaN (the step divides by its total target count)
    ls, n = causal_lm_loss_sum(torch.randn(1, 64, 8), torch.full((1, 64), IGNORE_INDEX))
    assert n == 0 and float(ls) == 0.0


def test_truncation_and_drop_counts(smol, tmp_path):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    long_answer = {"messages": [{"role": "user", "content": "Count"},
                                {"role": "assistant", "content": " ".join(["one two three"] * 30)}]}
    long_prompt = {"messages": [{"role": "user", "content": " ".join(["word"] * 200)},
                                {"role": "assistant", "content": "Ok."}]}
    src = _write(tmp_path, [short, long_answer, short, long_prompt, short])
    logs = []
    d = build_sft_data(src, "chat", _renderer(smol), seq_len=64, val_fraction=0.2, log=logs.append)
    assert d.n_train + d.n_val == 3
    assert "3 of 5 chat samples kept" in logs[0] and "2 longer than seq_len+1=65 tokens were dropped" in logs[0]
    logs = []
    d = build_sft_data(src, "chat", _renderer(smol), seq_len=64, val_fraction=0.2, truncation="truncate",
                       log=logs.append)
    # the long answer is cut to its start (kept); the long prompt leaves no answer token (dropped)
    assert d.n_train + d.n_val == 4
    assert "2 longer than seq_len+1=65 tokens were truncated" in logs[0] and "1 dropped with no trained token" in logs[0]
    rows = torch.cat([d.train_labels, d.val_labels])
    assert all(int((r[1:] != IGNORE_INDEX).sum()) > 0 for r in rows)
    with pytest.raises(DataError, match="data.truncation='cut'"):
        build_sft_data(src, "chat", _renderer(smol), seq_len=64, truncation="cut")


@pytest.mark.parametrize("row, msg", [
    ({"text": "hi"}, r"d.jsonl:2: 'messages' is missing"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"d.jsonl:2: messages\[0\] has unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, r"d.jsonl:2: no non-empty assistant message"),
    ("{not json", r"d.jsonl:2: malformed JSON line"),
])
def test_malformed_rows(smol, tmp_path, row, msg):
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    src = _write(tmp_path, [ok, row])
    with pytest.raises(DataError, match=msg) as ei:
        build_sft_data(src, "chat", _renderer(smol), seq_len=64)
    assert "\n" not in str(ei.value)


def test_prompt_completion_rows_checked(smol, tmp_path):
    src = _write(tmp_path, [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: field 'completion' must be a string \(missing\)"):
        build_sft_data(src, "prompt_completion", _renderer(smol), seq_len=64)


def test_botchan_chat_builtin_and_prepare(smol, tmp_path, monkeypatch):
    from types import SimpleNamespace as N

    from npu_train.data.prepare import prepare_data

    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    cfg = N(data=N(source="botchan-chat", format="chat", truncation="drop", seq_len=64, val_fraction=0.05),
            model=N(tokenizer=None))
    logs = []
    d = prepare_data(cfg, smol["path"], smol["cfg"], log=logs.append)
    assert d.train_labels is not None and d.n_train > 100
    assert list((tmp_path / "cache" / "data").glob("packed-*.safetensors"))
    x, y = micro_batch_tensors(d, torch.arange(4))
    assert ((y != IGNORE_INDEX).sum(1) > 0).all()
    cfg.data.format = "chatml"
    with pytest.raises(DataError, match="data.format='chatml'"):
        prepare_data(cfg, smol["path"], smol["cfg"])


def test_botchan_chat_asset_matches_its_rule(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "b.jsonl"
    subprocess.run([sys.executable, str(root / "scripts/make_botchan_chat.py"), str(out)], check=True,
                   env={"PYTHONPATH": str(root / "src")}, capture_output=True)
    shipped = root / "src/npu_train/data/assets/botchan_chat.jsonl"
    assert out.read_bytes() == shipped.read_bytes()
    assert shipped.stat().st_size < 1_000_000
