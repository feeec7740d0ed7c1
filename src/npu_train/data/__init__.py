"""Training data: sources (local files / save_to_disk directories through ``datasets``), token packing, chat / prompt-completion samples and the step sampler."""

from .dataset import (
    PackedData,
    build_packed_data,
    data_fingerprint,
    load_packed,
    micro_batch_tensors,
    packed_cache_path,
    save_packed,
    tokenize_documents,
)
from .chat import FORMATS, ChatRenderer
from .sampler import StepSampler
from .sft import build_sft_data
from .sources import Source, read_documents, read_text_source, resolve_source
from .text import DataError, botchan_text, strip_gutenberg

__all__ = [
    "ChatRenderer",
    "FORMATS",
    "build_sft_data",
    "DataError",
    "PackedData",
    "Source",
    "StepSampler",
    "botchan_text",
    "build_packed_data",
    "data_fingerprint",
    "load_packed",
    "micro_batch_tensors",
    "packed_cache_path",
    "read_documents",
    "read_text_source",
    "resolve_source",
    "save_packed",
    "strip_gutenberg",
    "tokenize_documents",
]
