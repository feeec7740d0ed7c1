#!/usr/bin/env python
"""Wall / CPU seconds and max RSS of one ``build_sft_data`` (chat, seq_len 256, truncate, packed) into an empty
cache, with whichever ``npu_train`` is on ``PYTHONPATH`` (alternate two trees to compare them).

``PYTHONPATH=<tree>/src python experiments/bench/data_sft_build_time.py MODEL_DIR CORPUS.jsonl``

``MODEL_DIR``: a model with a chat template, e.g. the ``tiny`` directory ``data_memory.py --format chat``
leaves in its work directory; ``CORPUS``: e.g. its ``chat-10mb.jsonl``.
"""
import os
import resource
import sys
import tempfile
import time

from npu_train.data.prepare import build_sft_data
from npu_train.data.render import ChatRenderer
from npu_train.model import chat_template, load_config, load_tokenizer, special_tokens


def main() -> None:
    model, corpus = sys.argv[1], sys.argv[2]
    cfg, tok = load_config(model), load_tokenizer(model)
    r = ChatRenderer(tok, chat_template(model), eos_id=cfg.eos_token_id, **special_tokens(model))
    with tempfile.TemporaryDirectory() as cache:
        t0, c0 = time.perf_counter(), time.process_time()
        d = build_sft_data(corpus, "chat", r, 256, 0.05, truncation="truncate", pad_id=0, cache_dir=cache, pack=True,
                           log=lambda m: None)
        print(f"{os.environ.get('PYTHONPATH', '')}: wall {time.perf_counter() - t0:.1f} s, cpu "
              f"{time.process_time() - c0:.1f} s, rows {d.n_train + d.n_val}, max RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
