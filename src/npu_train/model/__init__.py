"""The decoder of the supported families (Llama, Qwen2/2.5, Qwen3, Mistral: ``config.FAMILIES``): config, stage
modules, HF / GGUF weights and tokenizers. Start at ``llama.py``
(``StageModule``) and ``weights.py`` (``load_config``, ``load_tensors``).
"""
from npu_train import lazy_exports

#: public name -> submodule. Loaded on first use (PEP 562), so ``import npu_train.model.config``
#: (what the planner's dry run needs) does not import torch.
_EXPORTS = {
    "ModelFormatError": ".files", "embedded_model_path": ".files", "resolve_model_path": ".files",
    "clear_gguf_cache": ".gguf", "gguf_unpermute": ".gguf", "gguf_tensor_index": ".gguf",
    "chat_template": ".tokenizer", "load_tokenizer": ".tokenizer", "special_tokens": ".tokenizer",
    "check_weights": ".weights", "load_config": ".weights", "load_tensors": ".weights", "iter_tensors": ".weights",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
