"""Tokenizers and chat templates of a model (HF directory, tokenizer file or GGUF). GGUF BPE vocabularies
are pre-tokenized by their ``tokenizer.ggml.pre`` rule with llama.cpp's regexes (``src/llama-vocab.cpp``).
Start at :func:`load_tokenizer`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Optional

from npu_train.env import cache_dir

from .files import ModelFormatError, check_exists, hf_dir, is_gguf_path

__all__ = ["load_tokenizer", "chat_template", "special_tokens", "pre_tokenizer_for",
           "PRE_TOKENIZER_RULES", "GGUF_PRE_NAMES"]

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Qwen2/2.5/3 (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): Llama 3's rule with digits one by one
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")

#: llama.cpp pre-tokenizer rules (``llm_tokenizer_bpe`` regex_exprs), applied in order.
PRE_TOKENIZER_RULES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3_RE,),
    "qwen2": (_QWEN2_RE,),
    "gpt2": (_GPT2_RE,),
    # starcoder, refact, command-r, smollm, codeshell, exaone: digits one by one, then GPT-2
    "smollm": (r"\p{N}", _GPT2_RE),
}

#: ``tokenizer.ggml.pre`` value -> rule (llama.cpp's names for the accepted rules).
GGUF_PRE_NAMES: dict[str, str] = {
    "default": "default",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3",
    "gpt-2": "gpt2", "gpt2": "gpt2",
    "qwen2": "qwen2",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "command-r": "smollm",
    "codeshell": "smollm", "exaone": "smollm",
}

_CACHE_VERSION = "pre-v2"  # bump when the tokenizer built from a GGUF changes


def pre_tokenizer_for(pre: str, where: str = "tokenizer"):
    """The ``tokenizers`` pre-tokenizer for llama.cpp rule ``pre``; :class:`ModelFormatError` if not implemented."""
    from tokenizers import Regex, pre_tokenizers

    rule = GGUF_PRE_NAMES.get(str(pre))
    if rule is None:
        raise ModelFormatError(
            f"{where}: tokenizer.ggml.pre={pre!r} is not a supported pre-tokenizer rule "
            f"(supported: {', '.join(sorted(GGUF_PRE_NAMES))}); pass the model's HF tokenizer with "
            "model.tokenizer=<dir with tokenizer.json, or the tokenizer.json file>")
    steps = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_RULES[rule]]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` for ``path``: an HF directory, a ``tokenizer.json`` or a GGUF file (cached
    under ``cache_dir("tokenizers")``). Raises FileNotFoundError, or ModelFormatError when none can be built."""
    from tokenizers import Tokenizer

    path = os.path.expanduser(path)
    check_exists(path)
    if is_gguf_path(path):
        return _gguf_tokenizer(path)
    if os.path.isfile(path) and path.endswith(".json") and os.path.basename(path) != "config.json":
        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001
            raise ModelFormatError(f"{path}: not a tokenizers JSON file ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''})") from e
    d = hf_dir(path)
    tj = os.path.join(d, "tokenizer.json")
    if os.path.isfile(tj):
        return Tokenizer.from_file(tj)
    if not any(os.path.isfile(os.path.join(d, f)) for f in
               ("tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")):
        raise ModelFormatError(
            f"{d}: no tokenizer files (tokenizer.json / tokenizer_config.json) in the model directory; "
            "copy them from the original model or pass model.tokenizer=<dir or tokenizer.json file>")
    return _transformers_backend(d, gguf_file=None, what=d, lacks_json=True)


def _gguf_tokenizer(path: str):
    from tokenizers import Tokenizer

    from .gguf import file_key, gguf_field, gguf_reader

    real, size, mtime = file_key(path)
    key = hashlib.sha256(f"{_CACHE_VERSION}|{real}|{size}|{mtime}".encode()).hexdigest()[:32]
    cached = cache_dir("tokenizers") / f"{key}.json"
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:  # noqa: BLE001 - corrupt cache: rebuild
            pass
    r = gguf_reader(path)  # clear ModelFormatError for bad files before transformers sees them
    pre_tok = None
    if gguf_field(r, "tokenizer.ggml.model") == "gpt2":
        # llama.cpp: a BPE vocabulary without tokenizer.ggml.pre uses the "default" rule.
        pre_tok = pre_tokenizer_for(gguf_field(r, "tokenizer.ggml.pre") or "default", path)
    tok = _transformers_backend(os.path.dirname(os.path.abspath(path)),
                                gguf_file=os.path.basename(path), what=path)
    if pre_tok is not None:
        tok.pre_tokenizer = pre_tok
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        os.replace(tmp, cached)
    except Exception:  # noqa: BLE001 - OSError, or tokenizers' plain Exception ("No space left on device")
        with contextlib.suppress(OSError):  # the cache is an optimisation only: no partial file stays
            tmp.unlink()
    return tok


def _transformers_backend(d: str, gguf_file: Optional[str], what: str, lacks_json: bool = False):
    """The ``tokenizers`` backend of transformers' ``AutoTokenizer`` for ``d`` (or ``gguf_file``). Raises
    ModelFormatError naming ``what`` and the fix."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"{what}: building its tokenizer needs the `transformers` package "
            f"(pip install 'transformers>=4.45'), or provide a tokenizer.json"
        ) from e
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        hf_tok = AutoTokenizer.from_pretrained(d, **kwargs)
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0]
        if lacks_json:
            present = sorted(f for f in os.listdir(d) if f.startswith(("tokenizer", "vocab", "merges", "special_")))
            raise ModelFormatError(
                f"{what}: no tokenizer.json in {d}, and transformers could not build the tokenizer from "
                f"{', '.join(present)} there ({type(e).__name__}: {first}); copy the model's tokenizer.json into "
                f"{d} or pass model.tokenizer=<dir or tokenizer.json file>") from e
        raise ModelFormatError(f"{what}: could not build a tokenizer ({type(e).__name__}: {first}); "
                               "pass model.tokenizer=<dir or tokenizer.json file>") from e
    backend = getattr(hf_tok, "backend_tokenizer", None)
    if backend is None:
        raise ModelFormatError(f"{what}: no fast tokenizer available; provide tokenizer.json "
                               "or pass model.tokenizer=<dir or tokenizer.json file>")
    return backend


# ---------------------------------------------------------------------------------- chat template
def chat_template(path: str) -> Optional[str]:
    """The model's chat template (Jinja source) or None: GGUF ``tokenizer.chat_template``, or the HF
    directory's ``chat_template.jinja`` / ``tokenizer_config.json`` (``default`` of a list)."""
    path = os.path.expanduser(path)
    check_exists(path)
    if is_gguf_path(path):
        from .gguf import gguf_field, gguf_reader

        v = gguf_field(gguf_reader(path), "tokenizer.chat_template")
        return str(v) if v else None
    d = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    jinja = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tc = _tokenizer_config(d)
    t = tc.get("chat_template")
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t or None


def special_tokens(path: str) -> dict[str, Optional[str]]:
    """``{"bos_token": str|None, "eos_token": str|None}`` of the model, as chat templates use them."""
    path = os.path.expanduser(path)
    if is_gguf_path(path):
        from .gguf import gguf_field, gguf_reader

        r = gguf_reader(path)
        toks = r.fields.get("tokenizer.ggml.tokens")
        out: dict[str, Optional[str]] = {}
        for k in ("bos", "eos"):
            i = gguf_field(r, f"tokenizer.ggml.{k}_token_id")
            out[f"{k}_token"] = (bytes(toks.parts[toks.data[int(i)]]).decode("utf-8")
                                 if toks is not None and i is not None else None)
        return out
    d = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    tc = _tokenizer_config(d)

    def text(v):
        return v.get("content") if isinstance(v, dict) else v

    return {"bos_token": text(tc.get("bos_token")), "eos_token": text(tc.get("eos_token"))}


def _tokenizer_config(d: str) -> dict:
    p = os.path.join(d, "tokenizer_config.json")
    if not os.path.isfile(p):
        return {}
    try:
        with open(p, encoding="utf-8") as f:
            v = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{p}: invalid JSON ({e})") from e
    return v if isinstance(v, dict) else {}
