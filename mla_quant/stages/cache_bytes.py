"""Exact cache bytes per token per layer for every quant option, measured from filled caches at real MLA dims.

    python run.py experiment=cache_bytes                     # 4K / 32K / 128K, d_c=512, d_r=64 (DeepSeek-V2/V3)
    python run.py experiment=cache_bytes 'task.contexts=[4096]' 'task.options=[int4_joint]'

Each option's cache layer is filled with a synthetic latent (the bytes a format takes do not depend on the values),
its stored tensors are measured (codes, scales, zeros, the BF16 protected region) and compared with the formula:
used bytes (the valid tokens) and held bytes (whole blocks of `task.block_size` tokens, the protected buffers).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from mla_quant.metrics import bytes_key
from mla_quant.stages import StageResult
from mla_quant.cache.bytes import byte_table, format_byte_table
from mla_quant.record import write_text_atomic


BYTES_FIELDS = {"used_bytes_per_token_per_layer": "used_B_per_token", "held_bytes_per_token_per_layer": "held_B_per_token",
                "formula_bytes_per_token_per_layer": "formula_B_per_token", "held_over_used": "held_over_used",
                "pct_of_bf16": "pct_of_bf16"}  # the record's field -> the byte table's column


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    rows = byte_table(list(task.options), list(task.contexts), d_c=task.d_c, d_r=task.d_r, batch=task.batch_size,
                      chunk=task.chunk, block_size=task.block_size)
    metrics = {}
    for r in rows:
        for field, column in BYTES_FIELDS.items():
            metrics[bytes_key(r["option"], r["context"], field)] = r[column]
    table = format_byte_table(rows)
    head = (f"d_c={task.d_c}, d_r={task.d_r}, batch {task.batch_size}, blocks of {task.block_size} tokens, stored "
            f"dtype bfloat16 (protected and unquantized tokens)")
    write_text_atomic(run_dir / "cache_bytes.md", f"{head}\n\n{table}\n")
    print(head)
    print(table)
    mismatched = [r for r in rows if abs(r["used_B_per_token"] - r["formula_B_per_token"]) > 1e-9]
    message = f"measured bytes differ from the formula for {[(r['option'], r['context']) for r in mismatched]}"
    return StageResult(metrics=metrics, ok=not mismatched, message=message if mismatched else "")
