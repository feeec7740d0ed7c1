"""The shipped SmolLM2's tokenizer, chat template and renderer for data tests (skips when the model is missing)."""
from __future__ import annotations

import pytest


def smol_chat() -> dict:
    """``{"path", "cfg", "tok", "template", "specials", "hf" (transformers tokenizer with the template), "renderer"}``."""
    from transformers import PreTrainedTokenizerFast

    from npu_train.data.render import ChatRenderer
    from npu_train.model import chat_template, embedded_model_path, load_config, load_tokenizer, special_tokens

    try:
        path = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg, tok, template, specials = load_config(path), load_tokenizer(path), chat_template(path), special_tokens(path)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    hf.chat_template = template
    return {"path": path, "cfg": cfg, "tok": tok, "template": template, "specials": specials, "hf": hf,
            "renderer": ChatRenderer(tok, template, eos_id=cfg.eos_token_id, **specials)}
