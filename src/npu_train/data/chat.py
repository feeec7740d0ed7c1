"""Chat and prompt/completion rows (JSONL) rendered with the model's chat template, with label masks.

``chat``: ``{"messages": [{"role", "content"}, ...]}`` (at least one assistant message); ``prompt_completion``:
``{"prompt", "completion"}`` (a user/assistant pair, or plain text + EOS without a template). Only each
assistant message's content and its end-of-turn token are trained. The tokens come from the template's
``{% generation %}`` markers, else by rendering the prefixes ``messages[:i]`` (with generation prompt) and
``messages[:i+1]`` and finding the content between them; a row where that fails is an error naming it.
Main type: :class:`ChatRenderer`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

from npu_train.model.llama import IGNORE_INDEX

from .text import DataError, decode_utf8

__all__ = ["FORMATS", "ROLES", "ChatRenderer", "Sample", "read_rows", "row_messages", "BUILTIN_CHAT_SOURCES"]

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant")
#: built-in chat data sets: name -> asset file (see assets/SOURCE.md)
BUILTIN_CHAT_SOURCES = {"botchan-chat": "botchan_chat.jsonl"}
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Sample:
    """One tokenized row: ``ids`` (int token ids) and ``labels`` (same length; ``ids[j]`` where
    trained, else ``IGNORE_INDEX``), both *unshifted* (position ``j`` is token ``j``)."""

    ids: list[int]
    labels: list[int]
    where: str


# ------------------------------------------------------------------------------- reading rows
def _rows_of_file(path: Path, fmt: str) -> list[tuple[list[dict], str]]:
    text = decode_utf8(path.read_bytes(), path)
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON line ({e.msg} at column {e.colno}); "
                            f"each line must be one JSON object ({_shape_hint(fmt)})") from None
        out.append((row_messages(obj, fmt, where), where))
    return out


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


def read_rows(spec: str, fmt: str) -> list[tuple[list[dict], str]]:
    """``[(messages, "file:line"), ...]`` of a chat / prompt_completion source in file order: a built-in name
    (:data:`BUILTIN_CHAT_SOURCES`), a ``.jsonl`` or a directory of them. Raises FileNotFoundError /
    :class:`DataError`."""
    if spec in BUILTIN_CHAT_SOURCES:
        ref = resources.files("npu_train.data").joinpath("assets", BUILTIN_CHAT_SOURCES[spec])
        with resources.as_file(ref) as p:
            rows = _rows_of_file(Path(p), fmt)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data.source={spec!r}: no such file or directory ({path.resolve()}); use "
                                    f"{sorted(BUILTIN_CHAT_SOURCES)} or a .jsonl file / directory of them")
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file()) if path.is_dir() else [path]
        if path.is_file() and path.suffix.lower() != ".jsonl":
            raise DataError(f"{path}: data.format={fmt} needs a .jsonl file (one {_shape_hint(fmt)} per line)")
        rows = [r for f in files for r in _rows_of_file(f, fmt)]
    if not rows:
        raise DataError(f"data.source={spec!r}: no rows; add JSONL rows like {_shape_hint(fmt)}")
    return rows


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
        content = messages[i]["content"].strip()
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
