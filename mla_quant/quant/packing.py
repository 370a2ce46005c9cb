"""Bit packing of integer codes along the last dim: INT8 one per byte, INT4 two, INT2 four, INT3 eight in three bytes.

Layout (one rule for every width): the codes of a vector form an LSB-first bit stream. Code i occupies stream
bits [i*b, (i+1)*b), least significant bit first, and stream bit k is bit (k % 8) of byte k // 8. So:

    INT8: byte j = v[j]
    INT4: byte j = v[2j] | v[2j+1] << 4                          (low nibble first)
    INT2: byte j = v[4j] | v[4j+1] << 2 | v[4j+2] << 4 | v[4j+3] << 6
    INT3: 8 values in 3 bytes: the 24-bit little-endian word w = sum_i v[8j+i] << 3i is stored as bytes
          w & 0xFF, (w >> 8) & 0xFF, w >> 16 (value 2 straddles bytes 0/1, value 5 straddles bytes 1/2)

A vector of n codes packs into packed_dim(n, b) = ceil(n * b / 8) bytes; unused high bits of the last byte are 0.
Packed tensors are contiguous uint8 (..., packed_dim); `unpack` needs n back because the padding is ambiguous.

    packed = pack(codes, bits=4)          # codes (..., n) uint8 < 16 -> (..., ceil(n/2)) uint8
    codes = unpack(packed, bits=4, n=n)
"""

from __future__ import annotations

import torch

PACK_BITS = (2, 3, 4, 8)


def _check(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"cannot pack bits={bits!r}; allowed: {list(PACK_BITS)}")


def packed_dim(n: int, bits: int) -> int:
    """Bytes that n codes of `bits` bits take (ceil(n * bits / 8))."""
    _check(bits)
    return (n * bits + 7) // 8


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)


def pack(codes: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """codes (..., n) uint8 with values < 2^bits -> contiguous uint8 (..., ceil(n * bits / 8))."""
    _check(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack takes uint8 codes, got {codes.dtype}")
    if check and codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"code {int(codes.max())} does not fit in bits={bits} (max {(1 << bits) - 1})")
    n = codes.shape[-1]
    if bits == 8:
        return codes.contiguous()
    if bits == 3:
        v = _pad_last(codes, 8).to(torch.int32)
        v = v.reshape(*v.shape[:-1], -1, 8)  # (..., n/8, 8)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)
        word = (v << shifts).sum(-1, dtype=torch.int32)  # (..., n/8): disjoint bit fields, so sum == or
        byte_shifts = torch.tensor([0, 8, 16], dtype=torch.int32, device=codes.device)
        out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)  # (..., n/8, 3)
        out = out.reshape(*out.shape[:-2], -1)
    else:
        per_byte = 8 // bits
        v = _pad_last(codes, per_byte)
        v = v.reshape(*v.shape[:-1], -1, per_byte)  # (..., n/per_byte, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        out = (v << shifts).sum(-1, dtype=torch.uint8)  # disjoint bit fields: no carries
    return out[..., : packed_dim(n, bits)].contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packed (..., ceil(n * bits / 8)) uint8 -> codes (..., n) uint8."""
    _check(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack takes uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_dim(n, bits):
        raise ValueError(
            f"packed last dim {packed.shape[-1]} does not hold n={n} codes of {bits} bits "
            f"(expected {packed_dim(n, bits)})"
        )
    if bits == 8:
        return packed.contiguous()
    if bits == 3:
        p = _pad_last(packed, 3).to(torch.int32)
        p = p.reshape(*p.shape[:-1], -1, 3)  # (..., n/8, 3)
        word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # (..., n/8)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
        v = ((word.unsqueeze(-1) >> shifts) & 0x7).to(torch.uint8)  # (..., n/8, 8)
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        v = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., bytes, per_byte)
    return v.reshape(*v.shape[:-2], -1)[..., :n].contiguous()


def pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The spec of `pack`: write each code's bits into the LSB-first stream, one bit at a time."""
    _check(bits)
    n = codes.shape[-1]
    rows = codes.reshape(-1, n).tolist()
    out = torch.zeros(len(rows), packed_dim(n, bits), dtype=torch.uint8)
    for r, row in enumerate(rows):
        stream = bytearray(packed_dim(n, bits))
        for i, value in enumerate(row):
            for bit in range(bits):
                if (value >> bit) & 1:
                    k = i * bits + bit
                    stream[k // 8] |= 1 << (k % 8)
        out[r] = torch.tensor(list(stream), dtype=torch.uint8)
    return out.reshape(*codes.shape[:-1], packed_dim(n, bits))
