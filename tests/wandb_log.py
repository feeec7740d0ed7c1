"""Read back the per-step history of W&B offline runs (tests of ``metrics.logger=wandb``)."""
from __future__ import annotations

import glob
import json
import os
import struct


def read_wandb_history(run_dir: str) -> list[dict]:
    """Every ``history`` record of the offline runs under ``run_dir/wandb``: W&B's run log is the LevelDB
    log format (a 7-byte ``:W&B`` header, then 32 KiB blocks of records: crc32c u32, length u16, type u8 with
    1 full / 2 first / 3 middle / 4 last) holding ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
        pos, block, buf = 7, 32768, b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:  # block trailer
                pos += left
                continue
            _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            payload = data[pos + 7:pos + 7 + n]
            pos += 7 + n
            if kind == 0 and n == 0:
                break
            buf = payload if kind in (1, 2) else buf + payload
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(buf)
                if rec.WhichOneof("record_type") == "history":
                    rows.append({it.key or "/".join(it.nested_key): json.loads(it.value_json)
                                 for it in rec.history.item})
    return rows
