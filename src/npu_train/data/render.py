"""Stage 2 of :mod:`npu_train.data.prepare`: rows rendered into token ids, every format.

- ``text``: :func:`token_batches` tokenizes document pieces in ~1 MB batches with the tokenizers library's
  ``encode_batch`` (parallel over the host's cores), ``eos_id`` (or a blank line) between documents.
- ``chat`` / ``prompt_completion``: :class:`ChatRenderer` renders a row's messages with the model's chat
  template and labels them (:class:`Sample`): only each assistant message's content and its end-of-turn
  token are trained. The tokens come from the template's ``{% generation %}`` markers, else by rendering the
  prefixes ``messages[:i]`` (with generation prompt) and ``messages[:i+1]`` and finding the content between
  them (as given, leading / trailing whitespace included and trained, as transformers' assistant mask;
  stripped only when the template trims it); a row where that fails is an error naming it. Without a
  template, prompt_completion is plain text + EOS.
- ``preference``: :func:`pair_tokens` gives a pair's prompt and completion ids (:class:`PairTokens`) as TRL
  1.16's ``DPOTrainer`` does (``_prepare_dataset``): the prompt alone, prompt + chosen and prompt + rejected
  are each tokenized whole, and the completions start where the prompt's ids and each whole sequence's ids
  diverge (the shorter of the two common prefixes, TRL's ``common_prefix_length``); so a completion's first
  token is the one the model sees after the prompt at inference (a SentencePiece ``Metaspace`` tokenizer
  gives ``'The'``, not the ``'▁The'`` of the completion tokenized on its own; a byte-level BPE prompt
  ending in a space gives ``'ĠP'``, not ``'Ġ'`` + ``'P'``), and the end of a prompt that merges
  into the completion is left out (:attr:`PairTokens.left_out`; TRL warns of it). String rows: the text
  is tokenized with the tokenizer's special tokens (its BOS, if its post-processor adds one), the
  completions with the tokenizer's EOS text appended unless they end with it. Conversational rows: the
  prompt rendered with the chat template with ``add_generation_prompt=True``, the whole conversation
  without, each tokenized by transformers' ``apply_chat_template(tokenize=True)``. (Older TRL
  releases tokenized each completion on its own; TRL 1.16, the version the test extra installs, does not.)

:func:`rendered` renders a stream of rows one at a time; the first row that fails to render is raised once
every row has been read, so a bad row found by reading (stage 1) comes first."""
from __future__ import annotations

import contextlib
import itertools
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, TypeVar

import numpy as np

from npu_train.model.llama import IGNORE_INDEX

from .rows import PairText
from .sources import split_pieces
from .text import DataError, botchan_text

__all__ = ["BATCH_CHARS", "ChatRenderer", "PairTokens", "Sample", "chunk_safe", "common_prefix_length",
           "pair_tokens", "rendered", "token_batches", "tokenize_documents"]

R = TypeVar("R")
S = TypeVar("S")


def rendered(rows: Iterable[R], render_one: Callable[[R], S]) -> Iterator[S]:
    """``render_one(row)`` of each of ``rows``, in order. The first row that fails to render stops the
    rendering, but the rows are still read to their end (a bad row found by reading is raised first, as when
    every row is read before any is rendered); then that failure is raised. OSError (the disk) is raised
    at once."""
    failed: Optional[Exception] = None
    for row in rows:
        if failed is not None:
            continue
        try:
            out = render_one(row)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - raised once the rows are read (see the docstring)
            failed = e
            continue
        yield out
    if failed is not None:
        raise failed


# ----------------------------------------------------------------------------- text
_CHUNK_CHARS = 32_768


#: characters of text per encode_batch call (the tokenizers library spreads one call over the cores)
BATCH_CHARS = 1 << 20


def _split_chunks(doc: str, size: int = _CHUNK_CHARS) -> list[str]:
    """Cut ``doc`` into ~``size``-char pieces at line starts that begin with a non-space."""
    pieces, rest = split_pieces(doc, size)
    return pieces + [rest] if rest or not pieces else pieces


def _encode_doc(tokenizer, doc: str) -> list[int]:
    """Token ids of one document, chunked when that is exact (see :func:`chunk_safe`)."""
    chunks = _split_chunks(doc)
    if len(chunks) == 1:
        return tokenizer.encode(doc, add_special_tokens=False).ids
    first_two = tokenizer.encode(chunks[0] + chunks[1], add_special_tokens=False).ids
    encs = tokenizer.encode_batch(chunks, add_special_tokens=False)
    if first_two != encs[0].ids + encs[1].ids:
        return tokenizer.encode(doc, add_special_tokens=False).ids
    return [i for e in encs for i in e.ids]


def chunk_safe(tokenizer) -> bool:
    """Whether tokenizing a document in pieces cut at line starts equals tokenizing it whole (true for
    byte-level BPE: a pre-token never crosses a "\\n" followed by a non-space; false e.g. for a tokenizer that
    prepends a marker to its input). Probed on the first two pieces of the shipped Botchan text."""
    pieces, _ = split_pieces(botchan_text()[: 3 * _CHUNK_CHARS], _CHUNK_CHARS)
    whole = tokenizer.encode(pieces[0] + pieces[1], add_special_tokens=False).ids
    parts = tokenizer.encode_batch(pieces[:2], add_special_tokens=False)
    return whole == parts[0].ids + parts[1].ids


def token_batches(tokenizer, pieces: Iterable[tuple[int, str]], eos_id: int | None,
                  batch_chars: int = BATCH_CHARS) -> Iterator[tuple[np.ndarray, int]]:
    """``(ids, chars)``: uint32 token ids of consecutive pieces (``eos_id``, or the tokens of a blank line when
    None, between documents) and the characters they came from, about ``batch_chars`` characters per batch.
    Three threads: a reader prepares the next text batches, an encoder thread calls ``encode_batch_fast``
    (Rayon: all cores) on one batch after another, and this thread turns the previous batch's encodings into
    one array (``np.fromiter`` over the ids lists) meanwhile, so that Python work (which holds the GIL) does
    not leave the cores idle between two encode calls."""
    enc = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def encoded() -> Iterator[tuple[list, list, int]]:
        for batch, docs, chars in _prefetched(_text_batches(pieces, batch_chars)):
            yield enc(batch, add_special_tokens=False), docs, chars

    sep = [int(eos_id)] if eos_id is not None else None
    prev = None
    for encs, docs, chars in _prefetched(encoded(), depth=1, name="npt-data-encode"):
        if sep is None:
            sep = tokenizer.encode("\n\n", add_special_tokens=False).ids
        parts = []
        for d, e in zip(docs, encs):
            if prev is not None and d != prev:
                parts.append(sep)
            prev = d
            parts.append(e.ids)
        n = sum(map(len, parts))
        yield np.fromiter(itertools.chain.from_iterable(parts), dtype=np.uint32, count=n), chars


def _text_batches(pieces: Iterable[tuple[int, str]], batch_chars: int) -> Iterator[tuple[list, list, int]]:
    batch, docs, chars = [], [], 0
    for d, piece in pieces:
        batch.append(piece)
        docs.append(d)
        chars += len(piece)
        if chars >= batch_chars:
            yield batch, docs, chars
            batch, docs, chars = [], [], 0
    if batch:
        yield batch, docs, chars


def _prefetched(it: Iterator, depth: int = 2, name: str = "npt-data-read") -> Iterator:
    """``it``'s items, produced by a background thread (``name``) up to ``depth`` ahead: reading and parsing
    the source (pyarrow and file reads release the GIL) overlaps the tokenizer's ``encode_batch`` (which
    releases it too). An exception in the producer is raised here; the producer stops (and closes ``it``)
    when the consumer is closed."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((end, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((end, e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    th = threading.Thread(target=produce, name=name, daemon=True)
    th.start()
    try:
        while True:
            item, err = q.get()
            if item is end:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        while th.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            th.join(0.05)


def tokenize_documents(tokenizer, docs: list[str], eos_id: int | None) -> list[int]:
    """One token stream for ``docs`` (no special tokens; ``eos_id`` between documents, a blank line when None)."""
    whole = not chunk_safe(tokenizer)
    pieces = ((k, p) for k, d in enumerate(docs) for p in ([d] if whole else _split_chunks(d)))
    return [int(i) for ids, _ in token_batches(tokenizer, pieces, eos_id) for i in ids]


# ----------------------------------------------------------------------------- chat / prompt_completion
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Sample:
    """One tokenized row: ``ids`` (int token ids) and ``labels`` (same length; ``ids[j]`` where
    trained, else ``IGNORE_INDEX``), both *unshifted* (position ``j`` is token ``j``)."""

    ids: list[int]
    labels: list[int]
    where: str


class ChatRenderer:
    """Renders conversations with the Jinja chat ``template`` (None: only plain-text prompt_completion)
    through ``tokenizer`` and labels the assistant tokens; ``eos_id`` ends plain-text completions."""

    def __init__(self, tokenizer, template: Optional[str], bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, eos_id: Optional[int] = None):
        self.tok = tokenizer
        self.template = template
        self.eos_id = eos_id
        #: the EOS text TRL appends to string completions (the tokenizer's ``eos_token``; else ``eos_id``'s)
        self.eos_text = eos_token or (tokenizer.id_to_token(int(eos_id)) if eos_id is not None else None)
        self.special_ids = {i for i, a in tokenizer.get_added_tokens_decoder().items() if a.special}
        self._hf = None
        if template is not None:
            from transformers import PreTrainedTokenizerFast

            kw = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
            self._hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kw)
            self._hf.chat_template = template
        self.has_generation_markers = bool(template) and _GENERATION_RE.search(template) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (no tokenization)."""
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """``messages`` rendered and tokenized by transformers' ``apply_chat_template(tokenize=True)`` (the
        template's own special tokens only), as TRL's trainers tokenize conversations."""
        out = self._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           add_generation_prompt=add_generation_prompt)
        return list(out["input_ids"])

    def sample(self, messages: list[dict], where: str, fmt: str) -> Sample:
        """Tokenize one row and label it (see the module doc). Raises :class:`DataError` naming ``where``."""
        if self.template is None:
            if fmt != "prompt_completion":
                raise DataError(f"{where}: the model has no chat template (tokenizer.chat_template / "
                                "tokenizer_config.json chat_template), so data.format=chat cannot be rendered; "
                                "use a chat model, or data.format=prompt_completion")
            return self._plain(messages, where)
        try:
            text = self.render(messages)
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles)
            raise DataError(f"{where}: the chat template could not render this row "
                            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
        enc = self.tok.encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), list(enc.offsets)
        trained = [False] * len(ids)
        if self.has_generation_markers:
            self._mark_by_generation(messages, ids, trained, where)
        else:
            for i, m in enumerate(messages):
                if m["role"] == "assistant" and m["content"].strip():
                    self._mark_turn(messages, i, text, ids, offsets, trained, where)
        if not any(trained) or all(trained):
            raise DataError(f"{where}: could not separate the assistant tokens from the rest "
                            f"({sum(trained)} of {len(ids)} trained); check the chat template")
        return Sample(ids, [t if tr else IGNORE_INDEX for t, tr in zip(ids, trained)], where)

    def _plain(self, messages: list[dict], where: str) -> Sample:
        p = self.tok.encode(messages[0]["content"], add_special_tokens=False).ids
        c = self.tok.encode(messages[1]["content"], add_special_tokens=False).ids
        if self.eos_id is None:
            raise DataError(f"{where}: the model has neither a chat template nor an EOS token to end the completion")
        c = c + [int(self.eos_id)]
        return Sample(p + c, [IGNORE_INDEX] * len(p) + c, where)

    def _mark_turn(self, messages, i, text, ids, offsets, trained, where) -> None:
        prefix = self.render(messages[:i], add_generation_prompt=True) if i else ""
        upto = self.render(messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(prefix)):
            prefix = self.render(messages[:i]) if i else ""
            if not (text.startswith(upto) and upto.startswith(prefix)):
                # a template that renders a turn differently when it is the last one (Qwen3's empty <think>
                # block on the final answer): find the messages' contents one after another in the full text
                prefix, upto = text[: self._after_contents(messages[:i], text, i, where)], text
        # the content as given (its leading / trailing whitespace is trained, as transformers'
        # assistant mask does), else stripped (a template that trims it, e.g. Llama 3's `| trim`)
        content = messages[i]["content"]
        c0 = upto.find(content, len(prefix))
        if c0 < 0:
            content = content.strip()
            c0 = upto.find(content, len(prefix))
        if c0 < 0:
            raise DataError(f"{where}: assistant message {i} does not appear verbatim in the rendered template; "
                            "cannot find the assistant tokens")
        c1 = c0 + len(content)
        eot = False
        for j, (s, e) in enumerate(offsets):
            if e <= c0 or s >= len(upto):
                continue
            if s < c1:
                trained[j] = True
            elif ids[j] in self.special_ids:
                trained[j] = True  # the end-of-turn token closing this assistant message
                eot = True
                break
        if not eot:
            raise DataError(f"{where}: no end-of-turn special token after assistant message {i} in the rendered "
                            "template; cannot label the end of the answer")

    @staticmethod
    def _after_contents(messages, text, i, where) -> int:
        """Position in ``text`` just after the contents of ``messages`` found one after another."""
        pos = 0
        for m in messages:
            c = m["content"].strip()
            if not c:
                continue
            at = text.find(c, pos)
            if at < 0:
                raise DataError(f"{where}: message {messages.index(m)} does not appear verbatim in the rendered "
                                f"template; cannot find the tokens of assistant message {i}")
            pos = at + len(c)
        return pos

    def _mark_by_generation(self, messages, ids, trained, where) -> None:
        out = self._hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        if list(out["input_ids"]) != ids:
            raise DataError(f"{where}: transformers' tokenization of the chat template differs from the model "
                            "tokenizer's; cannot use its assistant mask")
        mask = list(out["assistant_masks"])
        for j, m in enumerate(mask):
            if m:
                trained[j] = True
                # the end-of-turn token right after a generation block is trained too
                if j + 1 < len(ids) and not mask[j + 1] and ids[j + 1] in self.special_ids:
                    trained[j + 1] = True


# ----------------------------------------------------------------------------- preference
@dataclass
class PairTokens:
    """Token ids (unpadded, untruncated) of one pair: the shared ``prompt`` and the two completions;
    ``left_out``: tokens of the prompt tokenized alone that are not in the training sequence (the prompt and
    prompt + completion diverge before the prompt's end: a token merged across the boundary, or a template
    that renders the prompt differently when an answer follows; TRL 1.16 warns and does the same)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    where: str
    left_out: int = 0


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Number of leading ids ``a`` and ``b`` share (TRL's ``common_prefix_length``)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _chat_ids(renderer: ChatRenderer, msgs: list[dict], where: str, gen: bool) -> list[int]:
    """``msgs`` rendered with the chat template and tokenized by transformers, as TRL's DPOTrainer does."""
    try:
        return list(renderer.chat_ids(msgs, add_generation_prompt=gen))
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles)
        raise DataError(f"{where}: the chat template could not render this row "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def _joint_ids(renderer: ChatRenderer, p: PairText) -> tuple[list[int], list[int], list[int]]:
    """The ids of the prompt alone, prompt + chosen and prompt + rejected, each tokenized whole."""
    if p.chat:
        if renderer.template is None:
            raise DataError(f"{p.where}: the model has no chat template, so conversational preference rows cannot "
                            "be rendered; use a chat model or string rows {\"prompt\", \"chosen\", \"rejected\"}")
        return (_chat_ids(renderer, p.prompt, p.where, True), _chat_ids(renderer, p.prompt + p.chosen, p.where, False),
                _chat_ids(renderer, p.prompt + p.rejected, p.where, False))
    eos = renderer.eos_text
    if eos is None:
        raise DataError(f"{p.where}: the model has no EOS token to end string completions; use conversational rows")
    enc = renderer.tok.encode  # with the tokenizer's special tokens (a BOS), as transformers' tokenizer(text)
    return (enc(p.prompt, add_special_tokens=True).ids,
            enc(p.prompt + _with_eos(p.chosen, eos), add_special_tokens=True).ids,
            enc(p.prompt + _with_eos(p.rejected, eos), add_special_tokens=True).ids)


def pair_tokens(renderer: ChatRenderer, p: PairText) -> PairTokens:
    """Token ids of one validated pair as TRL 1.16's ``DPOTrainer`` makes them (see the module doc): the prompt
    and prompt + completion tokenized whole, the completion starting where they diverge. Raises
    :class:`DataError` naming the row (no template / EOS, template errors)."""
    prompt, chosen, rejected = _joint_ids(renderer, p)
    n = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    return PairTokens(prompt[:n], chosen[n:], rejected[n:], p.where, len(prompt) - n)
