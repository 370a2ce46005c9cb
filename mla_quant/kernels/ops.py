"""The decode kernels as PyTorch operators with fake (meta) implementations: a decode step traces under
`FakeTensorMode` and `torch.compile` (each kernel one opaque node of the graph, no graph break) and a CUDA graph
captures it.

    out = decode_op("triton")(q_latent, q_rope, scale, segments)   # torch.ops.mla_quant.latent_decode
    out = decode_op("cpu")(q_latent, q_rope, scale, segments)      # torch.ops.mla_quant_cpu.latent_decode (C++)

An operator takes tensors and numbers only: `flatten(segments)` lays each `Segment` out as a list of tensors (None
where a part is absent, `SEGMENT_TENSORS` per segment) and a list of ints (per segment: each path's bits, group,
symmetric, pow2, its codes and what its scales are (`layout.CODES`, `layout.SCALE_KINDS`), the longest length (-1: none), whether it is dense rows, then the RoPE pairs descriptor
(`layout.flat_pairs`) after its length, 0 for none), and the Triton operator's
implementation rebuilds the segments (`unflatten`) to launch the kernel. The C++ kernel registers its own operator
(kernels/csrc/latent_decode_cpu.cpp); kernels/cpu_decode.py registers its fake implementation once it is loaded.
"""

from __future__ import annotations

import torch

from mla_quant.kernels.layout import (
    CODES, SCALE_KINDS, PagedPath, Segment, check_inputs, flat_pairs, in_bases, nested_pairs,
)

SEGMENT_TENSORS = 10  # per segment: content data, scales, zeros, levels; rope the same; block table; lengths
_PATH_META = 6  # per path: bits, group, symmetric, pow2, codes, what its scales are (-1: a float or pow2 dtype)


def _path_meta(p: PagedPath) -> list[int]:
    return [int(p.bits), int(p.group), int(bool(p.symmetric)), int(bool(p.pow2)), CODES.index(p.codes),
            -1 if p.scales_as is None else SCALE_KINDS.index(p.scales_as)]


def flatten(segments) -> tuple[list[torch.Tensor | None], list[int]]:
    """Segments -> (tensors, ints) for the operators (`unflatten` inverts it)."""
    tensors, meta = [], []
    for seg in segments:
        for p in (seg.content, seg.rope):
            tensors += [p.data, p.scales, p.zeros, p.levels]
        tensors += [seg.block_table, seg.lengths]
        pairs = () if seg.rope.pairs is None else flat_pairs(seg.rope.pairs)
        meta += [*_path_meta(seg.content), *_path_meta(seg.rope), -1 if seg.max_len is None else int(seg.max_len),
                 int(seg.rows), len(pairs), *pairs]
    return tensors, meta


def _path(parts: list, meta: list[int], pairs: tuple | None = None) -> PagedPath:
    bits, group, sym, pow2, codes, scales_as = meta
    return PagedPath(parts[0], parts[1], parts[2], bits, group, bool(sym), bool(pow2), parts[3], pairs,
                     codes=CODES[codes], scales_as=None if scales_as < 0 else SCALE_KINDS[scales_as])


def unflatten(tensors: list[torch.Tensor | None], meta: list[int]) -> list[Segment]:
    segments, at = [], 0
    for i in range(0, len(tensors), SEGMENT_TENSORS):
        t = tensors[i:i + SEGMENT_TENSORS]
        c_meta, r_meta = meta[at:at + _PATH_META], meta[at + _PATH_META:at + 2 * _PATH_META]
        at += 2 * _PATH_META
        max_len, rows, n_pairs = meta[at:at + 3]
        pairs = nested_pairs(meta[at + 3:at + 3 + n_pairs]) if n_pairs else None
        at += 3 + n_pairs
        segments.append(Segment(_path(t[0:4], c_meta), _path(t[4:8], r_meta, pairs), t[8], t[9],
                                None if max_len < 0 else max_len, bool(rows)))
    return segments


@torch.library.custom_op("mla_quant::latent_decode", mutates_args=())
def _triton_latent_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float,
                          tensors: list[torch.Tensor | None], meta: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from mla_quant.kernels.latent_decode import latent_decode

    return latent_decode(q_latent, q_rope, scale, unflatten(tensors, meta), return_lse=True)


@_triton_latent_decode.register_fake
def _(q_latent, q_rope, scale, tensors, meta):
    return (q_latent.new_empty(q_latent.shape, dtype=torch.float32),
            q_latent.new_empty(q_latent.shape[:2], dtype=torch.float32))


def decode_op(backend: str):
    """The decode kernel of `backend` ("triton", "cpu") as a function of (q_latent, q_rope, scale, segments) that
    calls its operator (both operators return the output and its log-sum-exp; segments in a rotated basis are read
    against the rotated query, `in_bases`, outside the operator)."""
    if backend == "triton":
        def triton_op(q_latent, q_rope, scale, segments, return_lse=False):
            def run(ql, qr, segs):
                tensors, meta = flatten(segs)
                return torch.ops.mla_quant.latent_decode(ql, qr, float(scale), tensors, meta)

            if any(p.rotation is not None for seg in segments for p in (seg.content, seg.rope)):
                check_inputs(q_latent, q_rope, segments)  # the rotations, before in_bases uses them (the operator
                # checks the rest, as it does for every other step: no second check on the common path)
            return in_bases(q_latent, q_rope, segments, run, return_lse)

        return triton_op
    from mla_quant.kernels.cpu_decode import latent_decode_cpu

    return latent_decode_cpu
