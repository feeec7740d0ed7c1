"""Chat and prompt/completion rows (any :mod:`~npu_train.data.sources` source) rendered with the model's chat template, with label masks.

``chat``: ``{"messages": [{"role", "content"}, ...]}`` (at least one assistant message); ``prompt_completion``:
``{"prompt", "completion"}`` (a user/assistant pair, or plain text + EOS without a template). Only each
assistant message's content and its end-of-turn token are trained. The tokens come from the template's
``{% generation %}`` markers, else by rendering the prefixes ``messages[:i]`` (with generation prompt) and
``messages[:i+1]`` and finding the content between them (as given, leading / trailing whitespace included
and trained, as transformers' assistant mask; stripped only when the template trims it); a row where that
fails is an error naming it.
Main type: :class:`ChatRenderer`."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from npu_train.config import DATA_FORMATS
from npu_train.model.llama import IGNORE_INDEX

from .sources import BUILTIN_CHAT, BadRows
from .text import DataError

__all__ = ["FIELDS", "FORMATS", "ROLES", "ChatRenderer", "Sample", "iter_rows", "read_rows", "row_messages",
           "BUILTIN_CHAT_SOURCES"]

FORMATS = DATA_FORMATS  # data.format values (their home: npu_train.config)
ROLES = ("system", "user", "assistant")
#: built-in chat data sets: name -> asset file (see assets/SOURCE.md)
BUILTIN_CHAT_SOURCES = BUILTIN_CHAT
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Sample:
    """One tokenized row: ``ids`` (int token ids) and ``labels`` (same length; ``ids[j]`` where
    trained, else ``IGNORE_INDEX``), both *unshifted* (position ``j`` is token ``j``)."""

    ids: list[int]
    labels: list[int]
    where: str


# ------------------------------------------------------------------------------- reading rows
def _shape_hint(fmt: str) -> str:
    if fmt == "chat":
        return '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
    return '{"prompt": "...", "completion": "..."}'


def row_messages(obj, fmt: str, where: str) -> list[dict]:
    """The validated ``messages`` of one JSONL row (``prompt_completion``: user + assistant);
    :class:`DataError` naming ``where`` (``file:line``) otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object like {_shape_hint(fmt)}, got {type(obj).__name__}")
    if fmt == "prompt_completion":
        for k in ("prompt", "completion"):
            if not isinstance(obj.get(k), str):
                got = "missing" if k not in obj else type(obj[k]).__name__
                raise DataError(f"{where}: field {k!r} must be a string ({got}); data.format=prompt_completion "
                                f"rows look like {_shape_hint(fmt)}")
        if not obj["completion"].strip():
            raise DataError(f"{where}: empty 'completion': nothing to train on; remove the row")
        return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        got = "missing" if "messages" not in obj else f"a {type(msgs).__name__}"
        raise DataError(f"{where}: 'messages' is {got}; data.format=chat rows look like {_shape_hint(fmt)}")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{k}] must be an object with a string 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: messages[{k}] has unknown role {role!r}; use one of {list(ROLES)}")
        out.append({"role": role, "content": m["content"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise DataError(f"{where}: no non-empty assistant message: nothing to train on; add one or remove the row")
    return out


#: the columns a row of each format needs (data.*_field maps them to the source's columns)
FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
          "preference": ("prompt", "chosen", "rejected")}


def iter_rows(spec: str, fmt: str, fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
              log: Callable[[str], None] = print, bad: Optional[BadRows] = None) -> Iterator[tuple[list[dict], str]]:
    """``(messages, "file:row")`` of each good row of a chat / prompt_completion source in file order, one
    at a time (memory: one batch of rows): a built-in name (:data:`BUILTIN_CHAT_SOURCES`), a JSON(L) /
    parquet / arrow file, a glob or directory of them, or a save_to_disk directory (``split``). ``fields``
    maps ``messages`` / ``prompt`` / ``completion`` to the source's column names. A bad row is an error
    naming it (``bad_rows="refuse"``) or is counted (in ``bad`` when given), reported through ``log`` with
    the first one after the last row, and dropped (``"skip"``). No good row at all: :class:`DataError` after
    the last row (saying whether the rows were all bad or there were none). Raises FileNotFoundError /
    :class:`DataError`."""
    from .sources import iter_converted, no_rows, resolve_source

    src = resolve_source(spec, fmt, split)
    names = {k: str((fields or {}).get(k) or k) for k in FIELDS[fmt]}

    def convert(b, i):
        obj = {k: b.columns[c][i] for k, c in names.items() if b.columns[c][i] is not None}
        return row_messages(obj, fmt, b.where(i)), b.where(i)

    n, bad = 0, bad if bad is not None else BadRows()
    for row in iter_converted(src, list(dict.fromkeys(names.values())), split, convert, bad_rows, log, bad=bad):
        n += 1
        yield row
    if not n:
        raise no_rows(spec, f" (split {split!r})" if src.kind == "saved" else "", bad, _shape_hint(fmt))


def read_rows(spec: str, fmt: str, fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
              log: Callable[[str], None] = print) -> list[tuple[list[dict], str]]:
    """:func:`iter_rows` as a list (small sources and tests; :func:`~npu_train.data.sft.build_sft_data`
    streams)."""
    return list(iter_rows(spec, fmt, fields, bad_rows, split, log))


# ------------------------------------------------------------------------------- rendering
class ChatRenderer:
    """Renders conversations with the Jinja chat ``template`` (None: only plain-text prompt_completion)
    through ``tokenizer`` and labels the assistant tokens; ``eos_id`` ends plain-text completions."""

    def __init__(self, tokenizer, template: Optional[str], bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, eos_id: Optional[int] = None):
        self.tok = tokenizer
        self.template = template
        self.eos_id = eos_id
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
