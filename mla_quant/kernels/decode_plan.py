"""How the Triton decode kernel (kernels/latent_decode.py) is launched, decided on the host without Triton: tile sizes
per head count and latent width (`launch_config`), and how each segment's tokens are split over programs so the
launch fills the GPU (`split_plan`, FlashMLA's get_mla_metadata)."""

from __future__ import annotations

import math

import torch


def next_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200, so that plans made on the CPU interpreter match the GPU's


def split_plan(batch: int, head_blocks: int, longest: list[int], block_n: int, num_sms: int,
               split_tokens: int | None = None, waves: int = 2, min_tiles: int = 4) -> list[tuple[int, int]]:
    """(tokens per split, splits) per segment. Like FlashMLA's get_mla_metadata: split the KV so that
    batch x head_blocks x splits fills about `waves` times the SMs, with splits of at least `min_tiles` tiles
    (so a short segment, e.g. the protected tokens, is one split); `split_tokens` forces a split length."""
    plan = []
    for n in longest:
        if split_tokens is not None:
            tps = max(1, split_tokens)
        else:
            wanted = max(1, math.ceil(waves * num_sms / max(1, batch * head_blocks)))
            most = max(1, math.ceil(n / (min_tiles * block_n)))
            tps = math.ceil(max(1, n) / min(wanted, most) / block_n) * block_n
        plan.append((tps, max(1, math.ceil(n / tps))))
    return plan


def merge_heads(batch: int, heads: int, num_sms: int, most: int = 8) -> int:
    """Heads per program of the merge (stage 2): up to `most` (FlashMLA's combine tiles 8; a [8, 512] float32
    accumulator is 32 registers per thread at 4 warps), as many as keep batch x head tiles >= the SMs, so a small batch
    still spreads the partial outputs' reads over the GPU (1 head per program where even that leaves SMs idle)."""
    tile = min(most, next_pow2(heads, 1))
    while tile > 1 and batch * math.ceil(heads / tile) < num_sms:
        tile //= 2
    return tile


def launch_config(heads: int, d_c: int, block_h: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None) -> dict:
    """Tile sizes: BLOCK_H heads per program, BLOCK_N tokens per tile, warps; any of them may be given. At d_c = 512
    the defaults are 16 heads, 32 tokens, 4 warps: the fastest of bench_kernel's candidates on an H200 for every
    format at 16 and 128 heads (docs/kernel.md, "Measured figures"), though the int paths' tiles then spill."""
    wide = d_c > 256
    bh = next_pow2(block_h or min(next_pow2(heads), 16 if wide else 64))
    bn = block_n or 32
    return dict(block_h=bh, block_n=bn, num_warps=num_warps or (8 if bh * d_c > 16 * 512 else 4))
