"""Training data, in stages (:mod:`npu_train.data.prepare`): read rows (sources, rows) -> render samples (render)
-> pack (pack, spool, the packed file: packfile) -> cache file with lock (cache) -> batches (sampler, batches).
Names are imported on first use (PEP 562): ``data.rows`` / ``data.sources`` (the launcher's check of
``data.source``) import no torch."""
from __future__ import annotations

from npu_train import lazy_exports

#: public name -> the submodule that defines it
_WHERE = {
    "micro_batch_tensors": ".batches",
    "packed_cache_path": ".cache",
    "text_fingerprint": ".cache",
    "PackedData": ".packfile",
    "load_packed": ".packfile",
    "save_packed": ".packfile",
    "build_packed_data": ".prepare",
    "build_preference_data": ".prepare",
    "build_sft_data": ".prepare",
    "ChatRenderer": ".render",
    "tokenize_documents": ".render",
    "FORMATS": ".rows",
    "StepSampler": ".sampler",
    "Source": ".sources",
    "read_documents": ".sources",
    "read_text_source": ".sources",
    "resolve_source": ".sources",
    "DataError": ".text",
    "botchan_text": ".text",
    "strip_gutenberg": ".text",
}

__all__ = sorted(_WHERE)


__getattr__ = lazy_exports(__name__, _WHERE)
