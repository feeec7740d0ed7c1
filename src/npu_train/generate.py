"""See what a model says: ``python -m npu_train.generate <model> --prompt "..."``. The model is a checkpoint
directory (or the checkpoints root, for its newest), a Hugging Face model directory of any family npu-train
trains (docs/models.md), ``embedded`` (the default job's model) or a ``.gguf`` file. The prompt goes through
the model's chat template unless ``--no-chat`` is given, and transformers' ``generate`` writes the answer.
A bad argument is refused with a one-line error that names the fix (exit status 2).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Callable, Optional


#: the forms ``<model>`` takes, for the errors about a path that is none of them
EXPECTED = ("pass a checkpoint directory (<run>/checkpoints for its newest checkpoint, or "
            "<run>/checkpoints/step_N), an export directory (python -m npu_train.checkpoint.export), a Hugging Face "
            "model directory with config.json, a .gguf file, or 'embedded'")


def _is_checkpoint(path: str) -> bool:
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return True
    return os.path.isdir(path) and any(n.startswith("step_") for n in os.listdir(path))


def _not_a_model(path: str) -> str:
    """The error for an existing ``path`` that is no model form: what it is, and what to pass instead."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(path):
        if os.path.isfile(os.path.join(parent, "manifest.json")):
            return f"{path} is one file of the checkpoint {parent}: pass the directory {parent}"
        if os.path.isfile(os.path.join(parent, "config.json")):
            return f"{path} is one file of the model directory {parent}: pass the directory {parent}"
        return f"{path} is not a model file (only .gguf files are loaded as such): {EXPECTED}"
    from npu_train.checkpoint.store import run_dir_error

    run_dir = run_dir_error(path, "model")
    if run_dir:
        return run_dir
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        if os.path.isfile(os.path.join(parent, "config.json")):
            return (f"{path} holds LoRA adapters only, not a model: pass the export directory {parent}, "
                    "whose model.safetensors has them merged")
        return (f"{path} holds LoRA adapters only, not a model: pass the export directory they came with "
                "(merged weights), or load them onto their base model with peft.PeftModel.from_pretrained")
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if ggufs:
        return f"{path} has no config.json but holds {ggufs}: pass one of them, e.g. {os.path.join(path, ggufs[0])}"
    return f"{path} has no config.json and no checkpoint (step_N/manifest.json): {EXPECTED}"


def resolve_for_generation(model: str) -> tuple[str, str]:
    """``(kind, path)`` of the ``<model>`` argument: ``"checkpoint"``, ``"gguf"`` or ``"hf"``, from file
    names only. Raises ``FileNotFoundError`` or :class:`~npu_train.errors.UserError` naming what to pass instead."""
    from npu_train.errors import UserError
    from npu_train.model.files import is_gguf_path, resolve_model_path

    path = os.path.expanduser(model)
    if os.path.isdir(path) and _is_checkpoint(path):
        return "checkpoint", path
    path = resolve_model_path(model)
    if not os.path.exists(path):  # generate's own forms (checkpoints, exports), not model.path's
        raise FileNotFoundError(f"model path {model!r} does not exist; {EXPECTED}")
    if is_gguf_path(path):
        return "gguf", path
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    raise UserError(_not_a_model(path))


def _gguf_model(path: str):
    """transformers' ``<Family>ForCausalLM`` (fp32; ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) with the GGUF
    file's weights as the trainer reads them (no transformers GGUF reader, which needs ``accelerate``)."""
    import torch
    import transformers

    from npu_train.checkpoint.export import hf_config_dict
    from npu_train.model import load_config, load_tensors
    from npu_train.model.config import FAMILIES
    from npu_train.model.llama import stage_param_names

    cfg = load_config(path)
    tensors = load_tensors(path, cfg, stage_param_names(cfg, 0, cfg.num_layers, True, True))
    d = hf_config_dict(cfg, "fp32")
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    cls = getattr(transformers, FAMILIES[cfg.family].architecture)
    return cls.from_pretrained(None, config=hf_cfg, state_dict=tensors, dtype=torch.float32)


def _quiet(_text: str) -> None:
    pass


#: the refusal of chat mode for a model without a chat template (before its weights are loaded)
NO_TEMPLATE = "the model has no chat template: pass --no-chat to send the prompt as raw text"


def template_source(kind: str, path: str, base: Optional[str] = None) -> Optional[str]:
    """Where the chat template of the resolved ``<model>`` (:func:`resolve_for_generation`) comes from: the model
    itself, or for a checkpoint the tokenizer its run recorded (the export copies that one's template; ``base``:
    a moved LoRA base, as for the export). None when the checkpoint recorded no tokenizer. Reads the manifest
    only; raises :class:`~npu_train.errors.UserError` for an incomplete checkpoint or a tokenizer that is gone."""
    if kind != "checkpoint":
        return path
    from npu_train.checkpoint.export import tokenizer_source
    from npu_train.checkpoint.store import CheckpointReader, find_checkpoint
    from npu_train.model.files import resolve_model_path

    reader = CheckpointReader(find_checkpoint(os.path.abspath(path), None,
                                              arg=f"python -m npu_train.generate <model>={path!r}"))
    src = tokenizer_source(reader, base, os.path.abspath(os.path.expanduser(base)) if base else None)
    return resolve_model_path(src) if src else None


def check_chat_template(kind: str, path: str, base: Optional[str] = None) -> None:
    """Raise ValueError (:data:`NO_TEMPLATE`) when the model has no chat template: checked from its files before
    the weights load (a checkpoint's merge and load took ~17 s before the same refusal came), the one place it
    is raised: a checkpoint that recorded no tokenizer has none either (its export writes no tokenizer files).
    A tokenizer that is gone raises :class:`~npu_train.errors.UserError` or ``FileNotFoundError``."""
    from npu_train.model import chat_template

    src = template_source(kind, path, base)
    if not src or not chat_template(src):
        raise ValueError(NO_TEMPLATE)


def _temp_space(refusal: str, ckpt: str) -> str:
    """An export refusal for want of disk space (``... MB free: free space there or give another output
    directory``) in generate's words: its export goes to a temporary directory under $TMPDIR, so the fix is
    another TMPDIR, or a one-time export to generate from."""
    head = refusal.split(": free space there or give another output directory")[0]
    return (f"{head}: generate merges the checkpoint into a temporary directory under $TMPDIR "
            f"({tempfile.gettempdir()}); set TMPDIR to a directory on a disk with room for it, or export the "
            f"checkpoint once (python -m npu_train.checkpoint.export {ckpt} <out dir>) and generate from <out dir>")


def load_for_generation(model: str, workdir: Optional[str] = None, note=_quiet, base: Optional[str] = None,
                        chat: bool = False):
    """``(transformers model, tokenizer)`` for ``model`` on the CPU in fp32; ``note(text)`` gets one line per
    phase (the command line prints them to stderr: a large model takes a minute to load); ``chat``: refuse a
    model without a chat template first (:func:`check_chat_template`, ValueError). Raises
    ``FileNotFoundError`` or :class:`~npu_train.errors.UserError` for a missing, wrong or damaged model."""
    kind, path = resolve_for_generation(model)
    if chat:
        check_chat_template(kind, path, base)
    note(f"loading {kind} {path} (imports first) ...")
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from npu_train.errors import UserError
    from npu_train.model import chat_template, check_weights, load_config, load_tokenizer, special_tokens

    if kind == "checkpoint":
        from npu_train.checkpoint.export import ExportDirError, export_hf

        note("merging the checkpoint's shards into a temporary Hugging Face directory (fp32) ...")
        try:
            path = export_hf(path, os.path.join(workdir or tempfile.mkdtemp(prefix="npt-gen-"), "hf"), "fp32",
                             arg=f"python -m npu_train.generate <model>={model!r}", overwrite=True, base=base,
                             say=note)
        except ExportDirError as e:  # generate has no output directory to give: name TMPDIR and the export
            raise ExportDirError(_temp_space(str(e), path)) from None
    if kind == "gguf":
        note(f"reading the weights of {path} into transformers (dequantised to fp32, CPU) and its tokenizer ...")
        m = _gguf_model(path)
        tok = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(path), **special_tokens(path))
    else:
        check_weights(path, load_config(path))  # a non-Llama config, a missing / truncated weights file: one line
        note(f"reading the weights of {path} into transformers (fp32, CPU) ...")
        try:
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise UserError(f"{path}: transformers cannot load the model ({type(e).__name__}: {first}); "
                            "re-export the checkpoint or re-download the model") from None
        tok = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(path),
                                      **{k: v for k, v in special_tokens(path).items() if v})
    tmpl = chat_template(path)
    if tmpl:
        tok.chat_template = tmpl
    m.eval()
    return m, tok


class WordStreamer:
    """transformers' ``streamer`` for :func:`generate`: the completion handed to ``on_text`` in pieces while it is
    generated, a word at a time (a 135 M model on a loaded 2-core host writes a few tokens a second; the whole
    reply used to come after a minute of silence).

    Each new token re-decodes the completion so far (``skip_special_tokens``, as the returned text) and passes on
    the text before its last whitespace that extends what was passed on: the last word can still change (a token
    that continues it, an incomplete UTF-8 character as ``\ufffd``, a tokenizer's clean-up of a space before
    punctuation). :meth:`finish` passes on the rest of the final text, so the pieces join to exactly the text
    :func:`generate` returns. The first :meth:`put` (the prompt's ids) is skipped."""

    def __init__(self, tok, on_text: Callable[[str], None]):
        self.tok, self.on_text = tok, on_text
        self.ids: list[int] = []
        self.sent = ""  # the text passed on so far, a prefix of every later decode
        self._prompt = True

    def put(self, value) -> None:
        """``value``: token ids, ``[1, n]`` (the prompt) or ``[1]`` / ``[1, 1]`` (one new token)."""
        if self._prompt:
            self._prompt = False
            return
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = max(text.rfind(c) for c in " \n\t")
        self._send(text[:cut] if cut > 0 else "")

    def end(self) -> None:
        """transformers' end of generation: nothing here (:meth:`finish` gets the final text)."""

    def finish(self, text: str) -> bool:
        """Pass on what ``text`` (the returned completion) adds to the pieces; False when the pieces are not a
        prefix of it (not seen: each piece was a prefix of a later decode of the same ids)."""
        if not text.startswith(self.sent):
            return False
        self._send(text)
        return True

    def _send(self, text: str) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            piece, self.sent = text[len(self.sent):], text
            self.on_text(piece)


def generate(model, tok, prompt: str, *, chat: bool = True, system: Optional[str] = None, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             on_text: Optional[Callable[[str], None]] = None) -> str:
    """The completion of ``prompt`` (decoded, prompt excluded). ``chat`` needs a tokenizer with a chat template
    (:func:`load_for_generation` with ``chat=True`` refuses a model without one before loading it; transformers
    raises ValueError for ``tok`` without one);
    ``temperature`` 0: greedy, else top-p sampling; stops at eos or ``max_new_tokens``. ``on_text``: gets the
    completion in pieces (words) while it is generated, which join to the returned text (:class:`WordStreamer`)."""
    import torch

    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    if ids["input_ids"].shape[1] == 0:
        raise ValueError("the prompt is empty (0 tokens): pass some text to continue from, or use the chat template")
    torch.manual_seed(seed)
    kw = dict(max_new_tokens=max_new_tokens, pad_token_id=tok.eos_token_id if tok.eos_token_id is not None else 0)
    if tok.eos_token_id is not None:
        kw["eos_token_id"] = tok.eos_token_id
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        kw.update(do_sample=False)
    streamer = WordStreamer(tok, on_text) if on_text is not None else None
    if streamer is not None:
        kw["streamer"] = streamer
    with torch.no_grad():
        out = model.generate(**ids, **kw)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if streamer is not None and not streamer.finish(text):
        on_text("\n" + text)  # the pieces went astray: the whole text again on its own line
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with its own errors (a missing ``--prompt``, ``--max-new-tokens abc``) as one ``error: ...`` line
    that names the fix, exit status 2, in place of the usage block (a fresh-clone review, issue 40)."""

    def error(self, message: str):  # type: ignore[override]
        from npu_train.errors import refusal_text

        import re

        opt = re.match(r"argument (\S+?)(?:/\S+)?: ", message)
        if "required" in message:
            fix = ("pass it, e.g. --prompt 'Hello'" if message.endswith(": --prompt") else
                   "e.g. embedded --prompt 'Hello'")
        elif "invalid" in message and opt:
            # the option's destination as argparse derives it ("--max-new-tokens" -> "max_new_tokens"), its
            # default through the public get_default (None for an unknown one)
            default = self.get_default(opt.group(1).lstrip(self.prefix_chars).replace("-", "_"))
            fix = f"give a number, e.g. {default} (the default)" if default is not None else "give a number"
        elif "unrecognized" in message:
            fix = "drop them (--help lists the options)"
        else:
            fix = "see --help for the options and their values"
        print(refusal_text(f"{message}: {fix}"), file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    # the module docstring's whole first paragraph (its first line alone stopped mid-sentence), without markup
    about = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")
    ap = _Parser(prog="python -m npu_train.generate", description=about)
    ap.add_argument("model", help="A checkpoint directory or the checkpoints root (its newest checkpoint), an "
                    "export or Hugging Face model directory, a .gguf file, or 'embedded' (the default job's model).")
    ap.add_argument("--prompt", required=True,
                    help="The user message the model answers (with --no-chat: the text it continues). Required.")
    ap.add_argument("--system", default=None, help="A system message, in chat mode (default: none).")
    ap.add_argument("--no-chat", action="store_true",
                    help="Send the prompt raw, without the chat template (default: the chat template).")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="The most tokens to generate, at least 1 (default: %(default)s).")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="The sampling temperature, 0 for greedy decoding (default: %(default)s).")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="Nucleus sampling: keep the likeliest tokens up to this probability, in (0, 1] "
                    "(default: %(default)s, all tokens).")
    ap.add_argument("--seed", type=int, default=0,
                    help="The random seed of the sampling (default: %(default)s).")
    ap.add_argument("--base", default=None,
                    help="For a LoRA checkpoint whose base model moved: where the base model is now "
                    "(default: the path its run recorded).")
    a = ap.parse_args(argv)
    from npu_train.errors import refusal_text

    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.max_new_tokens < 1:
        print(refusal_text("need --temperature >= 0 (0 = greedy), 0 < --top-p <= 1 and --max-new-tokens >= 1"),
              file=sys.stderr)
        return 2
    if a.no_chat and not a.prompt:  # nothing to continue from: refused before seconds of loading
        print(refusal_text("--prompt '' with --no-chat gives the model no token to continue from: pass some text "
                           "(e.g. --prompt 'Once upon a time'), or drop --no-chat to send an empty user message "
                           "through the chat template"), file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from npu_train.errors import UserError

    t0 = time.perf_counter()

    from npu_train.errors import console_columns
    from npu_train.metrics.report import fold_long_line

    def note(text: str) -> None:  # progress on stderr, folded at words; stdout: the completion
        # folded at stderr's console width (stdout, the completion, may be a pipe while stderr is the terminal)
        print(fold_long_line(f"generate: [{time.perf_counter() - t0:5.1f} s] {text}", console_columns(sys.stderr)),
              file=sys.stderr, flush=True)

    shown = []  # the completion's pieces on stdout so far: it is written while it is generated

    def show(piece: str) -> None:
        shown.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        with tempfile.TemporaryDirectory(prefix="npt-gen-") as wd:
            m, tok = load_for_generation(a.model, wd, note=note, base=a.base, chat=not a.no_chat)
            note(f"loaded; generating up to {a.max_new_tokens} tokens (the reply follows on stdout as it is "
                 "written) ...")
            generate(m, tok, a.prompt, chat=not a.no_chat, system=a.system, max_new_tokens=a.max_new_tokens,
                     temperature=a.temperature, top_p=a.top_p, seed=a.seed, on_text=show)
            print(flush=True)  # the completion's end of line: stdout holds the text and one newline, as before
    except (UserError, FileNotFoundError, ValueError) as e:
        print(refusal_text(str(e)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: one line, the temporary dir is gone
        if shown:  # the partial reply's line ends first
            print(flush=True)
        print("generate: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
