"""The decode kernels as PyTorch operators with fake (meta) implementations: a decode step traces under
`FakeTensorMode` and `torch.compile` (each kernel one opaque node of the graph, no graph break) and a CUDA graph
captures it.

    out = decode_op("triton")(q_latent, q_rope, scale, segments)   # torch.ops.mla_quant.latent_decode
    out = decode_op("cpu")(q_latent, q_rope, scale, segments)      # torch.ops.mla_quant_cpu.latent_decode (C++)

An operator takes tensors and numbers only: `flatten(segments)` lays each `Segment` out as a list of tensors (None
where a part is absent) and a list of ints (`SEGMENT_TENSORS` and `_segment_meta`), and the Triton operator's
implementation rebuilds the segments (`unflatten`) to launch the kernel. The C++ kernel registers its own operator
(kernels/csrc/latent_decode_cpu.cpp); kernels/cpu_decode.py registers its fake implementation once it is loaded.
"""

from __future__ import annotations

import torch

from mla_quant.kernels.layout import PagedPath, Segment

SEGMENT_TENSORS = 10  # per segment: content data, scales, zeros, levels; rope the same; block table; lengths
_PATH_META = 4  # per path: bits, group, symmetric, pow2


def _path_meta(p: PagedPath) -> list[int]:
    return [int(p.bits), int(p.group), int(bool(p.symmetric)), int(bool(p.pow2))]


def _flat_pairs(desc: tuple | None) -> list[int]:
    """A RoPE-pairs descriptor (1, interleaved, per, symmetric, groups of 8 ints) as [length, *ints] ([0]: none)."""
    if desc is None:
        return [0]
    *head, groups = desc
    flat = [*head, len(groups), *(int(v) for g in groups for v in g)]
    return [len(flat), *flat]


def _pairs_of(flat: list[int]) -> tuple | None:
    if not flat:
        return None
    head, n = tuple(flat[:4]), flat[4]
    return (*head, tuple(tuple(flat[5 + 8 * i: 13 + 8 * i]) for i in range(n)))


def flatten(segments) -> tuple[list[torch.Tensor | None], list[int]]:
    """Segments -> (tensors, ints) for the operators (`unflatten` inverts it)."""
    tensors, meta = [], []
    for seg in segments:
        for p in (seg.content, seg.rope):
            tensors += [p.data, p.scales, p.zeros, p.levels]
        tensors += [seg.block_table, seg.lengths]
        meta += [*_path_meta(seg.content), *_path_meta(seg.rope), -1 if seg.max_len is None else int(seg.max_len),
                 int(seg.rows), *_flat_pairs(seg.rope.pairs)]
    return tensors, meta


def unflatten(tensors: list[torch.Tensor | None], meta: list[int]) -> list[Segment]:
    segments, at = [], 0
    for i in range(0, len(tensors), SEGMENT_TENSORS):
        t = tensors[i:i + SEGMENT_TENSORS]
        c_meta, r_meta = meta[at:at + _PATH_META], meta[at + _PATH_META:at + 2 * _PATH_META]
        max_len, rows, n_pairs = meta[at + 2 * _PATH_META: at + 2 * _PATH_META + 3]
        pairs = _pairs_of(meta[at + 2 * _PATH_META + 3: at + 2 * _PATH_META + 3 + n_pairs])
        at += 2 * _PATH_META + 3 + n_pairs

        def path(parts, m, pairs=None):
            bits, group, sym, pow2 = m
            return PagedPath(parts[0], parts[1], parts[2], bits, group, bool(sym), bool(pow2), parts[3], pairs)

        segments.append(Segment(path(t[0:4], c_meta), path(t[4:8], r_meta, pairs), t[8], t[9],
                                None if max_len < 0 else max_len, bool(rows)))
    return segments


@torch.library.custom_op("mla_quant::latent_decode", mutates_args=())
def _triton_latent_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float,
                          tensors: list[torch.Tensor | None], meta: list[int]) -> torch.Tensor:
    from mla_quant.kernels.latent_decode import latent_decode

    return latent_decode(q_latent, q_rope, scale, unflatten(tensors, meta))


@_triton_latent_decode.register_fake
def _(q_latent, q_rope, scale, tensors, meta):
    return q_latent.new_empty(q_latent.shape, dtype=torch.float32)


def decode_op(backend: str):
    """The decode kernel of `backend` ("triton", "cpu") as a function of (q_latent, q_rope, scale, segments) that
    calls its operator."""
    if backend == "triton":
        def triton_op(q_latent, q_rope, scale, segments):
            tensors, meta = flatten(segments)
            return torch.ops.mla_quant.latent_decode(q_latent, q_rope, float(scale), tensors, meta)

        return triton_op
    from mla_quant.kernels.cpu_decode import latent_decode_cpu

    return latent_decode_cpu
