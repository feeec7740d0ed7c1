"""Training data, in stages (:mod:`npu_train.data.prepare`): read rows (sources, rows) -> render samples (render)
-> pack (pack, spool, the packed file: packfile) -> cache file with lock (cache) -> batches (sampler, batches)."""

from .batches import micro_batch_tensors
from .cache import packed_cache_path, text_fingerprint
from .packfile import PackedData, load_packed, save_packed
from .prepare import build_packed_data, build_preference_data, build_sft_data
from .render import ChatRenderer, tokenize_documents
from .rows import FORMATS
from .sampler import StepSampler
from .sources import Source, read_documents, read_text_source, resolve_source
from .text import DataError, botchan_text, strip_gutenberg

__all__ = [
    "ChatRenderer",
    "FORMATS",
    "build_preference_data",
    "build_sft_data",
    "DataError",
    "PackedData",
    "Source",
    "StepSampler",
    "botchan_text",
    "build_packed_data",
    "load_packed",
    "micro_batch_tensors",
    "packed_cache_path",
    "read_documents",
    "read_text_source",
    "resolve_source",
    "save_packed",
    "strip_gutenberg",
    "text_fingerprint",
    "tokenize_documents",
]
