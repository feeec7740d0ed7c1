"""Chat / prompt-completion data: assistant-only labels, padding, truncation, row errors."""
from __future__ import annotations

import json

import pytest
import torch

from npu_train.data import DataError
from npu_train.data.batches import micro_batch_tensors
from npu_train.data.packfile import load_packed, save_packed
from npu_train.data.prepare import build_sft_data
from npu_train.data.render import ChatRenderer
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
    from npu_train.data.rows import row_messages

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


def _labels(d, split: str = "train") -> torch.Tensor:
    """The unshifted labels ``[N, seq_len + 1]`` int64 of a built split: the file stores a uint8 target mask
    (1: the label is the token id; 0: IGNORE_INDEX)."""
    ids, mask = getattr(d, split), getattr(d, f"{split}_labels")
    return torch.where(mask.bool(), ids.to(torch.int64), IGNORE_INDEX)


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
    assert d.path is None and d.train_labels.dtype == torch.uint8  # mapped from a file already unlinked
    for b, row in enumerate((1, 0)):
        lab = _labels(d)[row]
        assert torch.equal(y[b], lab[1:]) and torch.equal(x[b], d.train[row, :-1].long())
        toks = d.train[row].tolist()
        n_pad = len(toks) - len("".join("p" if t == 2 else "x" for t in toks).rstrip("p"))  # trailing pad run
        assert n_pad > 0 and (lab[len(toks) - n_pad:] == IGNORE_INDEX).all()  # padding is never a target
        assert _trained_spans(smol["tok"], lab.tolist()) == [f"A{row}.{EOT}"]
    p = save_packed(d, tmp_path / "c.safetensors")
    d2 = load_packed(p)
    # stored compactly: labels as a uint8 target mask (1 byte a token); the micro-batches are unchanged
    assert d2.train_labels.dtype == torch.uint8 and d2.train.dtype == torch.uint16
    for split, n in (("train", d.n_train), ("val", d.n_val)):
        for a, b in zip(micro_batch_tensors(d2, torch.arange(n), split), micro_batch_tensors(d, torch.arange(n), split)):
            assert torch.equal(a, b)
    assert torch.equal(_labels(d2), _labels(d))
    # an all-masked micro-batch contributes 0, not NaN (the step divides by its total target count)
    ls, n = causal_lm_loss_sum(torch.randn(1, 64, 8), torch.full((1, 64), IGNORE_INDEX))
    assert n == 0 and float(ls) == 0.0


def test_bad_rows_count_among_the_rows_read(smol, tmp_path):
    """data.bad_rows=skip: the summary's "k of n samples kept" counts the skipped row in n (the line before it
    says "1 bad row(s) skipped"), so the two lines agree."""
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    robot = {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}
    logs = []
    build_sft_data(_write(tmp_path, [good, robot, good, good, good]), "chat", _renderer(smol), seq_len=64,
                   bad_rows="skip", log=logs.append)
    assert logs[0].startswith("data: 1 bad row(s) skipped (data.bad_rows=skip); first: ") and ".jsonl:2" in logs[0]
    assert logs[1].startswith("data: 4 of 5 chat samples kept (1 bad row(s) skipped) (one per sequence"), logs[1]


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
    rows = torch.cat([_labels(d), _labels(d, "val")])
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


# ------------------------------------------------------------------------------- packing (data.pack)
def _segments(ids: torch.Tensor, pos: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run starting at position 0 (the row's samples; padding stays in the last)."""
    starts = [int(j) for j in torch.nonzero(pos == 0).flatten()]
    return list(zip(starts, starts[1:] + [ids.numel()]))


def test_packed_rows_hold_the_same_samples(smol, tmp_path):
    """pack=True: greedy fill in file order; every sample once, unchanged; positions restart per sample;
    labels IGNORE at every sample start; padding (pad_id, IGNORE) only at a row's tail."""
    rows = [{"messages": [{"role": "user", "content": "Q" * (1 + i % 7) + f" {i}?"},
                          {"role": "assistant", "content": f"A{i}." + " ok" * (i % 5)}]} for i in range(40)]
    src = _write(tmp_path, rows)
    PAD, ROW = 0, 193  # id 0 (<|endoftext|>) never occurs in a rendered sample
    flat = build_sft_data(src, "chat", _renderer(smol), seq_len=ROW - 1, val_fraction=0.1, pad_id=PAD,
                          log=lambda m: None)
    logs = []
    packed = build_sft_data(src, "chat", _renderer(smol), seq_len=ROW - 1, val_fraction=0.1, pad_id=PAD, pack=True,
                            log=logs.append)
    assert "packed into" in logs[0] and packed.n_tokens == flat.n_tokens
    # data.seq_len tokens a sequence, as the job line says (the row's extra token is the last target)
    assert f"packed into {packed.n_train + packed.n_val} sequences of {ROW - 1} tokens (" in logs[0], logs[0]
    assert flat.train_positions is None and packed.train_positions.shape == packed.train.shape
    assert packed.n_train < flat.n_train / 2  # several samples per sequence

    def strip(ids, lab):  # trailing padding off
        m = len(ids)
        while m and ids[m - 1] == PAD:
            m -= 1
        assert all(x == IGNORE_INDEX for x in lab[m:])
        return ids[:m], lab[:m]

    for split in ("train", "val"):
        f_ids, f_lab = getattr(flat, split), _labels(flat, split)
        p_ids, p_lab, p_pos = (getattr(packed, split), _labels(packed, split),
                               getattr(packed, f"{split}_positions").long())
        want = [strip(f_ids[r].tolist(), f_lab[r].tolist()) for r in range(f_ids.shape[0])]
        got, prev_used = [], None
        for r in range(p_ids.shape[0]):
            segs = _segments(p_ids[r], p_pos[r])
            assert segs[0][0] == 0
            row = []
            for k, (a, b) in enumerate(segs):
                assert p_pos[r, a:b].tolist() == list(range(b - a))
                ids, lab = p_ids[r, a:b].tolist(), p_lab[r, a:b].tolist()
                assert lab[0] == IGNORE_INDEX and ids[0] != PAD
                row.append(strip(ids, lab) if k == len(segs) - 1 else (ids, lab))
            assert all(PAD not in ids for ids, _ in row)  # padding only at the tail
            if prev_used is not None:  # greedy: this row's first sample did not fit in the previous row
                assert prev_used + len(row[0][0]) > ROW
            prev_used = sum(len(ids) for ids, _ in row)
            got += row
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [g[1][1:] for g in got] == [w[1][1:] for w in want]  # the same trained tokens
    # targets: none predicts a sample start; the trained targets are those of the samples
    x, y = micro_batch_tensors(packed, torch.arange(packed.n_train))
    starts = packed.train_positions[:, 1:] == 0
    assert (y[starts] == IGNORE_INDEX).all()
    assert int((y != IGNORE_INDEX).sum()) == int((micro_batch_tensors(flat, torch.arange(flat.n_train))[1]
                                                  != IGNORE_INDEX).sum())
    from npu_train.data.batches import micro_batch_positions

    assert torch.equal(micro_batch_positions(packed, torch.tensor([1, 0])), packed.train_positions[[1, 0], :-1].long())
    assert micro_batch_positions(flat, torch.tensor([0])) is None
    d2 = load_packed(save_packed(packed, tmp_path / "p.safetensors"))
    # stored compactly (uint16) and memory-mapped; the same values
    assert torch.equal(d2.train_positions.to(torch.int64), packed.train_positions.long())
    assert torch.equal(d2.val_positions.to(torch.int64), packed.val_positions.long())


def test_text_doc_mask_positions(smol, tmp_path):
    """data.doc_mask: positions restart at each row start and after every EOS; targets of an EOS are not trained."""
    from npu_train.data.prepare import build_packed_data

    d = tmp_path / "docs"
    d.mkdir()
    for i in range(6):
        (d / f"{i}.txt").write_text(f"Document {i}. " + "Some words here. " * (3 + i), encoding="utf-8")
    eos = smol["cfg"].eos_token_id
    data = build_packed_data(str(d), smol["tok"], 24, 0.2, eos_id=eos, doc_mask=True)
    from npu_train.data.batches import micro_batch_positions

    assert data.doc_eos == eos and data.train_positions is None  # computed from the ids on read, not stored
    rows = torch.cat([data.train, data.val]).to(torch.int64)
    pos = torch.cat([micro_batch_positions(data, torch.arange(data.n_train)),
                     micro_batch_positions(data, torch.arange(data.n_val), split="val")])
    for r in range(rows.shape[0]):
        p = 0
        for j in range(rows.shape[1] - 1):  # the inputs' positions (the row's last token is a target only)
            if j == 0 or rows[r, j - 1] == eos:
                p = 0
            assert pos[r, j] == p, (r, j)
            p += 1
    assert (rows[:, :-1] == eos).any()
    x, y = micro_batch_tensors(data, torch.arange(data.n_train))
    assert (y[x == eos] == IGNORE_INDEX).all() and (y[x != eos] != IGNORE_INDEX).all()
    plain = build_packed_data(str(d), smol["tok"], 24, 0.2, eos_id=eos)
    assert plain.train_positions is None and plain.fingerprint != data.fingerprint
    with pytest.raises(DataError, match="data.doc_mask=false"):
        build_packed_data(str(d), smol["tok"], 24, 0.2, eos_id=None, doc_mask=True)


# ------------------------------------------------------------------------------- vs apply_chat_template
# Qwen2.5-style ChatML (default system prompt, content not trimmed, no generation markers)
_QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
         "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
         "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == "
         "'system' and loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
         "'\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Meta Llama-3-Instruct's template (content trimmed, BOS first)
_LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
           "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
           "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
           "{% endif %}")
_LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WHITESPACE_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Question one?"},
    {"role": "assistant", "content": "Answer.\n"},
    {"role": "user", "content": "And two?"},
    {"role": "assistant", "content": "Two: 84. "},
    {"role": "user", "content": "Three?"},
    {"role": "assistant", "content": "  Three.\n\n"},
]


def _hand_mask(hf, msgs, eot: str) -> list[int]:
    """Assistant mask built from renderings alone: for assistant turn i, the characters from the end of
    ``render(messages[:i], add_generation_prompt=True)`` through the first ``eot`` after it in
    ``render(messages[:i+1])``; a token is trained iff one of its characters lies in such a span (as
    transformers' ``return_assistant_tokens_mask``, which marks ``char_to_token`` of the span's ends and all
    between: a token straddling the span's start, e.g. ``"\\n "`` before ``"  Three."``, is trained)."""
    text = hf.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(hf.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True))
        upto = hf.apply_chat_template(msgs[: i + 1], tokenize=False)
        assert text.startswith(upto)
        spans.append((start, upto.index(eot, start) + len(eot)))
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]], enc["input_ids"]


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_assistant_mask_equals_hand_built(smol, style):
    """Qwen-style and Llama-3-style templates (no generation markers): the trained tokens equal the mask
    built by hand from transformers' apply_chat_template renderings, whitespace-ending answers included
    (issue 28: ``"Answer.\\n"`` lost its trailing newline token)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(smol["tok"].to_str())
    if style == "llama3":
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _LLAMA3_SPECIALS])
        template, eot, specials = _LLAMA3, "<|eot_id|>", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    else:
        template, eot, specials = _QWEN, EOT, {"eos_token": EOT}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()), **specials)
    hf.chat_template = template
    want, ids = _hand_mask(hf, WHITESPACE_TURNS, eot)
    s = ChatRenderer(tok, template, eos_id=None, **specials).sample(WHITESPACE_TURNS, "t:1", "chat")
    assert s.ids == ids
    got = [int(x != IGNORE_INDEX) for x in s.labels]
    assert got == want, (_trained_spans(tok, s.labels), _trained_spans(tok, [i if w else IGNORE_INDEX
                                                                             for i, w in zip(ids, want)]))
    if style == "qwen":  # the whitespace is there and trained
        assert _trained_spans(tok, s.labels)[0] == "Answer.\n" + EOT


@pytest.mark.parametrize("fmt, example", [
    ("chat", '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'),
    ("prompt_completion", '{"prompt": "...", "completion": "..."}'),
    ("preference", '{"prompt": "...", "chosen": "...", "rejected": "..."}'),
])
def test_a_malformed_line_shows_a_row_of_the_format(tmp_path, fmt, example):
    """rev4 POLISH 1: a malformed line of a chat source was answered with the text format's example
    (``{"text": "..."}``): the example row has the columns the format reads."""
    from npu_train.data.rows import iter_pairs, read_rows

    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
                 '{"messages": [}\n')
    with pytest.raises(DataError) as ei:
        list(iter_pairs(str(p))) if fmt == "preference" else read_rows(str(p), fmt)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:2: malformed JSON line") and msg.endswith(f"e.g. {example}"), msg
