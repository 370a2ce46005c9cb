"""Checkpoint weight files read without loading them: a safetensors file's header checked against its size (a side
module: the standard library only, so every loader can use it)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
                     "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def check_safetensors(file: Path) -> dict:
    """Refuse a .safetensors file whose header or size is not what the format says (corrupt or truncated), naming
    the file and what is wrong, before transformers reads it. -> the header ({tensor: {dtype, shape, data_offsets}},
    and __metadata__)."""
    size = file.stat().st_size

    def bad(why: str):
        return ValueError(f"weight file {file} is not a valid safetensors file: {why}; it is corrupt or incompletely "
                          f"copied: replace it")

    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise bad(f"its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise bad(f"its {n}-byte header is not JSON ({err})") from None
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            expected = numel * SAFETENSORS_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has no valid dtype/shape/data_offsets") from None
        if info["dtype"] in SAFETENSORS_BYTES and stop - begin != expected:
            raise bad(f"tensor {name!r} ({info['dtype']} {info['shape']}) spans {stop - begin} bytes, needs {expected}")
        end = max(end, stop)
    if 8 + n + end != size:
        raise bad(f"its tensors end at byte {8 + n + end} but the file has {size} bytes")
    return header
