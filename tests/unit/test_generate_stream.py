"""``python -m npu_train.generate`` writes the reply while it is generated (a fresh-clone review waited 61 s for the
whole of it at once), and the pieces join to exactly the text :func:`npu_train.generate.generate` returns.

A stand-in model hands the streamer one token at a time, as transformers' ``generate`` does (the prompt's ids
first), so the test needs no weights; the tokenizers are real: the shipped SmolLM2's byte-level BPE and a
SentencePiece-style ``Metaspace`` BPE trained here."""
from __future__ import annotations

import pytest
import torch

#: multi-byte characters split across byte-level tokens, double spaces, a newline, punctuation after a space
TEXT = ("The master of the school said: «Café, naïve — 東京!» Hello  world .\nNext line, tab\there; "
        "don 't stop 123456789 ok")


class _Stepper:
    """Stand-in for a transformers model: ``generate`` puts the prompt, then ``new_ids`` one by one, into the
    streamer, and records how many pieces ``pieces`` held after each token."""

    def __init__(self, new_ids: list[int], pieces: list):
        self.new_ids, self.pieces, self.after_token = new_ids, pieces, []

    def generate(self, input_ids, attention_mask=None, streamer=None, **kw):
        out = input_ids
        if streamer is not None:
            streamer.put(input_ids)
        for t in self.new_ids[:kw["max_new_tokens"]]:
            out = torch.cat([out, torch.tensor([[t]])], dim=1)
            if streamer is not None:
                streamer.put(torch.tensor([t]))
                self.after_token.append(len(self.pieces))
        if streamer is not None:
            streamer.end()
        return out


def _smol():
    from smol_chat import smol_chat

    return smol_chat()["hf"]


def _metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator([TEXT] * 3 + ["the a of to and in is it you that he was for on are"],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("make_tok", [_smol, _metaspace], ids=["byte-level-bpe", "metaspace"])
def test_the_reply_comes_in_pieces_that_join_to_the_returned_text(make_tok):
    from npu_train.generate import generate

    tok = make_tok()
    new_ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    pieces: list[str] = []
    model = _Stepper(new_ids, pieces)
    text = generate(model, tok, "Once upon a time", chat=False, max_new_tokens=len(new_ids), on_text=pieces.append)
    assert text == tok.decode(new_ids, skip_special_tokens=True)  # what the command printed before
    assert "".join(pieces) == text
    # written while it was generated: most of the text was out before the last token came
    assert len(pieces) > 5 and model.after_token[-1] > len(pieces) // 2
    assert sum(len(p) for p in pieces[:model.after_token[-1]]) > len(text) // 2


def test_without_on_text_no_streamer_is_passed():
    """The library call without ``on_text`` generates as before (no ``streamer`` keyword)."""
    from npu_train.generate import generate

    tok = _metaspace()
    ids = tok("Hello world", add_special_tokens=False)["input_ids"]

    class Plain(_Stepper):
        def generate(self, input_ids, attention_mask=None, **kw):
            assert "streamer" not in kw
            return super().generate(input_ids, attention_mask, **kw)

    assert generate(Plain(ids, []), tok, "Hi", chat=False, max_new_tokens=8) == tok.decode(ids)


def test_cli_writes_the_reply_as_it_comes_and_one_newline(monkeypatch, capsys):
    """``main``: stdout is the reply and one newline, as when it was printed at the end, written in pieces."""
    import npu_train.generate as G

    tok = _metaspace()
    new_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    writes: list[str] = []
    model = _Stepper(new_ids, writes)
    monkeypatch.setattr(G, "load_for_generation", lambda *a, **k: (model, tok))

    class Out:  # records every write to stdout
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", Out())
    assert G.main(["whatever", "--prompt", "Once", "--no-chat", "--max-new-tokens", str(len(new_ids))]) == 0
    assert "".join(writes) == tok.decode(new_ids, skip_special_tokens=True) + "\n"
    assert model.after_token[-1] > 3  # several writes before the last token
    assert "generating up to" in capsys.readouterr().err
