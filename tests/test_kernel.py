"""The Triton decode kernel against its PyTorch reference (Triton's CPU interpreter here, set in conftest.py; on a GPU
box run with TRITON_INTERPRET=0: the tests then run on CUDA, and those marked `gpu` run only there), reading the
quantized cache's stored tensors in place."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import CPU_DECODE, HAS_CXX
from omegaconf import OmegaConf

from dataclasses import replace

from mla_quant.cache import LatentCacheLayer, cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
from mla_quant.calibration.codebooks import fitted_on
from mla_quant.kernels.latent_decode import latent_decode
from mla_quant.kernels.torch_decode import latent_decode_reference, segment_attention
from mla_quant.models.absorbed import cache_kwargs, quantized_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def filled_layer(quant: dict, d_c: int, d_r: int, batch: int, tokens: int, dtype=torch.float32, seed: int = 0,
                 pads: tuple[int, ...] = (), device: str = DEVICE):
    """One cache layer on `device` after a prefill and single-token decode appends; sequence i left-padded by pads[i]
    slots, so sequences hold different numbers of sinks, quantized and recent tokens."""
    from mla_quant.cache import layer_factory
    from mla_quant.quant.formats import cache_format

    cfg = OmegaConf.merge(load_quant_option(quant.pop("option", "int4_joint")), quant)
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(batch, tokens, d_c, generator=g).to(device, dtype)
    r = (3 * torch.randn(batch, tokens, d_r, generator=g)).to(device, dtype)
    layer = layer_factory(fitted_on(cache_format(cfg, d_c, d_r, context=4096), c, r))()
    valid = torch.ones(batch, tokens, dtype=torch.bool, device=device)
    for i, pad in enumerate(pads):
        valid[i, :pad] = False
    first = tokens * 2 // 3
    layer.append(c[:, :first], r[:, :first], valid[:, :first])  # a prefill, then single-token decode appends
    for i in range(first, tokens):
        layer.append(c[:, i : i + 1], r[:, i : i + 1], valid[:, i : i + 1])
    return layer


def dense_attention(layer, q_latent, q_rope, scale):
    """Independent of the kernel's inputs: the layer's own decoded tokens per sequence, attended in float64."""
    compact, lengths = layer.read_compact(torch.float64)
    s = torch.einsum("bhd,bsd->bhs", q_latent.double(), compact["content"])
    s = (s + torch.einsum("bhd,bsd->bhs", q_rope.double(), compact["rope"])) * scale
    ok = torch.arange(s.shape[-1], device=s.device)[None, :] < lengths[:, None]
    p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bsd->bhd", p, compact["content"]).float()


FORMATS = {
    "bf16 (plain layer)": {"option": "bf16"},
    "int4 g32 + int4 rope": {"content": {"group_size": 32}},
    "int2 g32 + int4 rope": {"option": "int2_content_int4_rope", "content": {"group_size": 32}},
    "int8 g96 sym + bf16 rope": {"option": "int4_content", "content": {"bits": 8, "group_size": 96,
                                                                       "symmetric": True}},
    "int4 pow2 sym + int8 rope": {"content": {"group_size": 32, "symmetric": True, "scale_dtype": "pow2"},
                                  "rope": {"bits": 8}},
    "int4 bf16 scales, no recent": {"content": {"group_size": 48, "scale_dtype": "bf16"},
                                    "protected": {"n_sink": 2, "recent": 0}},
    # bits per group of RoPE pairs (format=pairs): the key's page read as bytes, 16 = values
    "int4 g32 + pairs rope [8, 3, 2, 16]": {"content": {"group_size": 32}, "rope": {"bits": [8, 3, 2, 16]}},
    # 2 bits on both paths at transformers' 2-bit bytes: the RoPE key's scale and zero per 4 channels, HQQ's zeros
    "int2 g32 hqq + int2 rope g4 hqq": {"option": "int2_joint", "content": {"group_size": 32, "quantizer": "hqq"},
                                        "rope": {"group_size": 4, "quantizer": "hqq"}},
    # codebooks (quantizer=lloyd): a select over levels held in registers
    "int2 g32 lloyd + int4 rope lloyd": {"option": "int2_content_int4_rope",
                                         "content": {"group_size": 32, "quantizer": "lloyd"},
                                         "rope": {"quantizer": "lloyd"}},
}


# the engines' formats (floating-point byte codes, read in channel order): e4m3 and e2m1 codes, scales of every kind
ENGINE_FORMATS = {
    "fp8_ds_mla: e4m3 g32 fp32 + bf16 rope, protected": {"option": "fp8_ds_mla", "content": {"group_size": 32},
                                                          "protected": {"n_sink": 2, "recent": 16}},
    "e4m3 per token pow2 + e4m3 g8 bf16": {"option": "fp8_ds_mla", "content": {"group_size": None,
                                                                               "scale_dtype": "pow2"},
                                           "rope": {"format": "fp8", "bits": 8, "group_size": 8, "symmetric": True,
                                                    "scale_dtype": "bf16"}},
    "mxfp8: e8m0 per 32, the rope's one short block": {"option": "mxfp8"},
    "nvfp4_ds_mla: e2m1 + e4m3 scales, unscaled e4m3 rope": {"option": "nvfp4_ds_mla"},
    "fp4_e2m1: e2m1 + e8m0 per 16": {"option": "fp4_e2m1", "protected": {"n_sink": 0, "recent": 16}},
    "turboquant_k8v4: unscaled e4m3 + per-token fp16": {"option": "turboquant_k8v4"},
}

@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("heads", [1, 20])  # one head block, partly filled; two, the second partly filled
def test_kernel_matches_reference(name, heads):
    layer = filled_layer(dict(FORMATS[name]), d_c=96, d_r=16, batch=3, tokens=190, pads=(0, 9, 77))
    if name != "bf16 (plain layer)":
        assert layer.n_quantized > 0
    segments = layer.segments()
    g = torch.Generator().manual_seed(1)
    q_latent = torch.randn(3, heads, 96, generator=g).to(DEVICE)
    q_rope = torch.randn(3, heads, 16, generator=g).to(DEVICE)
    out = latent_decode(q_latent, q_rope, 0.12, segments, block_n=16, split_tokens=48)  # several splits
    ref = latent_decode_reference(q_latent, q_rope, 0.12, segments)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}, {heads} heads: {m}")
    torch.testing.assert_close(ref, dense_attention(layer, q_latent, q_rope, 0.12), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(ENGINE_FORMATS))
def test_kernel_reads_the_engines_byte_codes(name):
    """e4m3 / e2m1 codes with their scales (float, pow2, E8M0, e4m3, none), read in place against the reference, which
    decodes them with the format's own codec (`PagedPath.decode`), and the layer's own decoded tokens."""
    layer = filled_layer(dict(ENGINE_FORMATS[name]), d_c=96, d_r=16, batch=3, tokens=190, pads=(0, 9, 77))
    assert layer.n_quantized > 0
    segments = layer.segments()
    assert segments[0].content.codes in ("e4m3", "e2m1")
    g = torch.Generator().manual_seed(1)
    q_latent, q_rope = torch.randn(3, 5, 96, generator=g).to(DEVICE), torch.randn(3, 5, 16, generator=g).to(DEVICE)
    out = latent_decode(q_latent, q_rope, 0.12, segments, block_n=16, split_tokens=48)
    ref = latent_decode_reference(q_latent, q_rope, 0.12, segments)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(ref, dense_attention(layer, q_latent, q_rope, 0.12), rtol=1e-4, atol=1e-5)


def test_e4m3_codes_of_a_width_that_is_not_whole_words_are_read_a_byte_at_a_time():
    """d_c 90 (groups of 30) and d_r 14: a token's e4m3 bytes are not whole int32 words, so the kernel reads them a
    byte per value (`_codes_constexpr`); the same output as the reference."""
    from mla_quant.kernels.latent_decode import _codes_constexpr

    quant = {"option": "fp8_ds_mla", "content": {"group_size": 30},
             "rope": {"format": "fp8", "bits": 8, "group_size": None, "symmetric": True, "scale_dtype": "fp16"}}
    layer = filled_layer(quant, d_c=90, d_r=14, batch=2, tokens=150, pads=(0, 31))
    segments = layer.segments()
    assert (_codes_constexpr(segments[0].content, 90), _codes_constexpr(segments[0].rope, 14)) == (1, 1)
    g = torch.Generator().manual_seed(3)
    q_latent, q_rope = torch.randn(2, 4, 90, generator=g).to(DEVICE), torch.randn(2, 4, 14, generator=g).to(DEVICE)
    out = latent_decode(q_latent, q_rope, 0.1, segments, block_n=16, split_tokens=48)
    torch.testing.assert_close(out, latent_decode_reference(q_latent, q_rope, 0.1, segments), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, dense_attention(layer, q_latent, q_rope, 0.1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("option, d_c, extra", [("nvfp4_ds_mla", 96, {}), ("mxfp8", 96, {}),
                                                ("turboquant_3bit_nc", 128, {"protected": {"n_sink": 2, "recent": 16}})])
def test_engine_formats_decode_through_the_triton_kernel_as_torch_does(option, d_c, extra):
    """quant.backend=triton (and cpu, the C++ kernel, where it builds) on an engine's format: decode steps read its
    pages through the kernel, with the outputs of the PyTorch layer over the same stored tokens."""
    from mla_quant.cache import layer_factory
    from mla_quant.quant.formats import cache_format

    g = torch.Generator().manual_seed(5)
    c, r = torch.randn(2, 150, d_c, generator=g).to(DEVICE), (3 * torch.randn(2, 150, 16, generator=g)).to(DEVICE)
    q = torch.randn(2, 4, 1, d_c, generator=g).to(DEVICE), torch.randn(2, 4, 1, 16, generator=g).to(DEVICE)
    outs = {}
    for backend in ("torch", "triton", *(("cpu",) if HAS_CXX else ())):
        cfg = OmegaConf.merge(load_quant_option(option), extra, {"backend": backend})
        layer = layer_factory(cache_format(cfg, d_c, 16))()
        layer.append(c[:, :140], r[:, :140])
        outs[backend] = [layer.attend(*q, c[:, i : i + 1], r[:, i : i + 1], 0.1, None) for i in range(140, 143)]
        assert layer.backend_steps[("decode", backend)] == 3
    for backend in set(outs) - {"torch"}:
        for got, want in zip(outs[backend], outs["torch"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{backend}: {m}")


def test_bad_byte_code_paths_are_named_before_launch():
    from mla_quant.kernels.layout import PagedPath, Segment

    codes = torch.zeros(2, 4, 8, dtype=torch.uint8, device=DEVICE)
    rope = PagedPath(torch.zeros(2, 4, 2, device=DEVICE))
    table, lengths = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), torch.full((1,), 5, device=DEVICE)
    q, qr = torch.zeros(1, 1, 8, device=DEVICE), torch.zeros(1, 1, 2, device=DEVICE)
    scales = torch.zeros(2, 4, 1, dtype=torch.uint8, device=DEVICE)
    for path, match in [
        (PagedPath(codes, None, None, 4, 8, codes="e4m3"), r"content.codes='e4m3' with bits=4; allowed"),
        (PagedPath(codes, None, None, 8, 8, codes="e5m2"), r"content.codes='e5m2'; allowed: \['words', 'e4m3'"),
        (PagedPath(codes[..., :4], None, None, 8, 8, codes="e4m3"), r"content.data: uint8 e4m3 codes \(.., 8\)"),
        (PagedPath(codes, scales, None, 8, 8, codes="e4m3"), r"content.scales: torch.uint8 as None"),
        (PagedPath(codes, scales, None, 8, 4, codes="e4m3", scales_as="e8m0"), r"content.scales must be \(num_blocks, "
                                                                               r"block_size, 2\)"),
        (PagedPath(codes[..., :6], None, None, 5, 8, codes="stream"), r"content.codes='stream' with bits=5; allowed"),
        (PagedPath(codes[..., :3], None, None, 3, 8, codes="stream"), r"content.levels: a stream's codebook of 8 "
                                                                      r"contiguous float32 levels expected, got None"),
        (PagedPath(codes, None, None, 8, 8, codes="e4m3", rotation=torch.eye(8, device=DEVICE)),
         r"content.rotation: a rotated basis is read for a stream of codebook indices only"),
        (PagedPath(codes[..., :3], None, None, 3, 8, levels=torch.arange(8.0, device=DEVICE), codes="stream",
                   rotation=torch.eye(4, device=DEVICE)), r"content.rotation: a contiguous \(8, 8\) float32 matrix"),
    ]:
        with pytest.raises(ValueError, match=match):
            latent_decode(q, qr, 1.0, [Segment(path, rope, table, lengths)])


def test_every_e4m3_and_e2m1_code_and_scale_byte_reads_as_torch_casts_it():
    """All 254 finite e4m3 codes (both zeros, the subnormals), all 16 e2m1 codes, and E8M0 / e4m3 scale bytes across
    their range: one token per code, attended by one-hot queries, returns each value exactly."""
    from mla_quant.kernels.layout import PagedPath, Segment
    from mla_quant.quant.codecs.nvfp4 import e2m1_values
    from mla_quant.quant.quantizers import FP8_DTYPE

    e4m3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    cases = [  # (codes per token (n, row), scales (n, 1) or None, scales_as, codes kind, expected first value)
        (e4m3[:, None], None, None, "e4m3", e4m3.view(FP8_DTYPE).float()),
        (torch.arange(16, dtype=torch.uint8)[:, None], torch.full((16, 1), 127, dtype=torch.uint8), "e8m0", "e2m1",
         e2m1_values(torch.arange(16, dtype=torch.uint8))),
        (torch.full((254, 1), 0x38, dtype=torch.uint8), torch.arange(254, dtype=torch.uint8)[:, None], "e8m0",
         "e4m3", torch.exp2(torch.arange(254).double() - 127).float()),  # e4m3 1.0 times 2^(s - 127), s = 0 too
        (torch.full((254, 1), 0x38, dtype=torch.uint8), e4m3[:, None], "e4m3", "e4m3",
         e4m3.view(FP8_DTYPE).float()),
    ]
    for codes, scales, scales_as, kind, want in cases:
        n = codes.shape[0]
        pages = codes.reshape(n, 1, 1).to(DEVICE)  # one token per block; d = 1 channel (2 for e2m1's byte)
        sc = None if scales is None else scales.reshape(n, 1, 1).to(DEVICE)
        path = PagedPath(pages, sc, None, 8 if kind == "e4m3" else 4, 1, True, codes=kind, scales_as=scales_as)
        rope = PagedPath(torch.zeros(n, 1, 1, device=DEVICE))
        table = torch.arange(n, dtype=torch.int32, device=DEVICE)[None, :]
        seg = Segment(path, rope, table, torch.tensor([n], dtype=torch.int32, device=DEVICE))
        q = torch.zeros(1, 1, 1, device=DEVICE)  # equal scores: the output is the mean of the values
        for i in range(0, n, 97):  # the value of token i alone: a block table of that one block
            one = Segment(path, rope, table[:, i:i + 1].contiguous(), torch.ones(1, dtype=torch.int32, device=DEVICE))
            got = latent_decode(q, torch.zeros(1, 1, 1, device=DEVICE), 1.0, [one])
            assert got.item() == want[i].item(), (kind, scales_as, i, got.item(), want[i].item())
        got = latent_decode(q, torch.zeros(1, 1, 1, device=DEVICE), 1.0, [seg])
        torch.testing.assert_close(got[0, 0, 0].double(), want.double().mean(), rtol=1e-6, atol=0)
        for torch_path in (latent_decode_reference, segment_attention):  # the PyTorch paths' own rule for raw pages
            torch.testing.assert_close(torch_path(q, torch.zeros(1, 1, 1, device=DEVICE), 1.0, [seg]), got)


TURBOQUANT = {  # TurboQuant's 3- and 4-bit presets (a power-of-two latent): codebook indices of the rotated vector
    "turboquant_4bit_nc: 4-bit streams, read as words": {"option": "turboquant_4bit_nc"},
    "turboquant_3bit_nc, sinks and a recent window": {"option": "turboquant_3bit_nc",
                                                      "protected": {"n_sink": 2, "recent": 16}},
    "turboquant_k3v4_nc, a recent window": {"option": "turboquant_k3v4_nc", "protected": {"n_sink": 0, "recent": 16}},
}


@pytest.mark.parametrize("name", list(TURBOQUANT))
def test_kernels_read_turboquant_streams_in_the_rotated_basis(name):
    """The codes index Lloyd-Max levels of the Hadamard-rotated vector: both kernels read them against the rotated
    query and rotate their output back (`in_bases`), the protected BF16 segments in the original basis, the two
    merged by their log-sum-exp; the output of the reference (the codec's own decoding), of the PyTorch segment path
    and of the layer's decoded tokens."""
    from mla_quant.kernels.latent_decode import _codes_constexpr

    layer = filled_layer(dict(TURBOQUANT[name]), d_c=128, d_r=16, batch=3, tokens=190, pads=(0, 9, 77))
    segments = layer.segments()
    body = segments[0]
    assert body.content.codes == body.rope.codes == "stream" and body.content.rotation is not None
    assert _codes_constexpr(body.content, 128) == (7 if body.content.bits == 4 else 3)  # 3 bits cross bytes
    assert len(segments) == 1 + sum(v > 0 for v in TURBOQUANT[name].get("protected", {}).values())
    g = torch.Generator().manual_seed(1)
    q_latent, q_rope = torch.randn(3, 5, 128, generator=g).to(DEVICE), torch.randn(3, 5, 16, generator=g).to(DEVICE)
    ref = latent_decode_reference(q_latent, q_rope, 0.12, segments)
    torch.testing.assert_close(ref, dense_attention(layer, q_latent, q_rope, 0.12), rtol=1e-4, atol=1e-5)
    outs = {"triton": latent_decode(q_latent, q_rope, 0.12, segments, block_n=16, split_tokens=48),
            "segment_attention": segment_attention(q_latent, q_rope, 0.12, segments)}
    if HAS_CXX and DEVICE == "cpu":
        from mla_quant.kernels.cpu_decode import latent_decode_cpu

        outs["cpu"] = latent_decode_cpu(q_latent, q_rope, 0.12, segments)
    for kernel, out in outs.items():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}, {kernel}: {m}")


def test_a_stream_of_codebook_indices_in_any_rotated_basis_and_its_lse():
    """Raw pages, no codec at hand: 3- and 4-bit streams at widths whose values cross bytes and end mid-byte, a random
    codebook, a float16 scale per group (the last one shorter), each path under a random orthogonal rotation (not
    symmetric, so q R^T and out R cannot be confused), beside a BF16 segment in the original basis; both kernels
    against the reference's own reading (the stream's bits one by one, x = y R), and the log-sum-exp they return
    against the scores', -inf for a sequence with no token."""
    from mla_quant.kernels.layout import PagedPath, Segment
    from mla_quant.quant import packing

    g = torch.Generator().manual_seed(11)
    blocks, bs, b, h = 6, 8, 3, 4
    dims, group = {"content": (20, 3), "rope": (6, 4)}, 8
    paths, decoded = {}, {}
    for name, (d, bits) in dims.items():
        codes = torch.randint(0, 1 << bits, (blocks, bs, d), generator=g, dtype=torch.uint8)
        levels = torch.randn(1 << bits, generator=g).sort().values
        scales = (torch.rand(blocks, bs, -(-d // group), generator=g) + 0.5).half()
        rot = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float().contiguous()
        y = levels[codes.long()] * scales.float().repeat_interleave(group, -1)[..., :d]
        decoded[name] = y.double() @ rot.double()  # what the tokens are, by this test's own arithmetic
        paths[name] = PagedPath(packing.pack(codes, bits).to(DEVICE), scales.to(DEVICE), None, bits, group,
                                levels=levels.to(DEVICE), codes="stream", rotation=rot.to(DEVICE))
    assert (torch.linalg.matrix_norm(paths["content"].rotation - paths["content"].rotation.T) > 0.1).item()
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [5, 0, 0]], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([19, 24, 0], dtype=torch.int32, device=DEVICE)
    dense_c, dense_r = torch.randn(b, 5, 20, generator=g), torch.randn(b, 5, 6, generator=g)
    dense_len = torch.tensor([5, 2, 0], dtype=torch.int32)
    segments = [Segment(paths["content"], paths["rope"], table, lengths),
                Segment.dense(dense_c.to(DEVICE), dense_r.to(DEVICE), dense_len.to(DEVICE))]
    q, qr = torch.randn(b, h, 20, generator=g), torch.randn(b, h, 6, generator=g)
    want_out = torch.zeros(b, h, 20, dtype=torch.float64)
    want_lse = torch.full((b, h), float("-inf"), dtype=torch.float64)
    for i in range(b):
        idx = (table[i].long().cpu()[:, None] * bs + torch.arange(bs)).reshape(-1)[: int(lengths[i])]
        keys_c = torch.cat([decoded["content"].reshape(-1, 20)[idx], dense_c[i, : int(dense_len[i])].double()])
        keys_r = torch.cat([decoded["rope"].reshape(-1, 6)[idx], dense_r[i, : int(dense_len[i])].double()])
        if len(keys_c):
            s = 0.3 * (q[i].double() @ keys_c.T + qr[i].double() @ keys_r.T)
            want_lse[i] = torch.logsumexp(s, -1)
            want_out[i] = torch.softmax(s, -1) @ keys_c
    q, qr = q.to(DEVICE), qr.to(DEVICE)
    torch.testing.assert_close(latent_decode_reference(q, qr, 0.3, segments).double().cpu(), want_out, rtol=1e-4,
                               atol=1e-5)
    runs = {"triton": lambda **kw: latent_decode(q, qr, 0.3, segments, block_n=16, split_tokens=16, **kw)}
    if HAS_CXX and DEVICE == "cpu":
        from mla_quant.kernels.cpu_decode import latent_decode_cpu

        runs["cpu"] = lambda **kw: latent_decode_cpu(q, qr, 0.3, segments, **kw)
    for kernel, run in runs.items():
        out, lse = run(return_lse=True)
        torch.testing.assert_close(out.double().cpu(), want_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kernel}: {m}")
        torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kernel}: {m}")
        torch.testing.assert_close(run(), out)


def test_kernel_with_128_heads_small_dims():
    """DeepSeek-V3's 128 heads per program, with small latent dims so the interpreter stays quick."""
    layer = filled_layer({"content": {"group_size": 16}, "rope": {"bits": 4}}, d_c=32, d_r=8, batch=2, tokens=150,
                         pads=(3,))
    g = torch.Generator().manual_seed(2)
    q_latent, q_rope = torch.randn(2, 128, 32, generator=g).to(DEVICE), torch.randn(2, 128, 8, generator=g).to(DEVICE)
    segments = layer.segments()
    out = latent_decode(q_latent, q_rope, 0.2, segments, block_n=16, split_tokens=64)
    torch.testing.assert_close(out, dense_attention(layer, q_latent, q_rope, 0.2), rtol=1e-4, atol=1e-5)


def test_kernel_reads_the_stored_codes_in_place():
    """Flipping one stored code moves the kernel's output exactly as it moves the reference's."""
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=1, tokens=160)
    q_latent, q_rope = torch.randn(1, 4, 64, device=DEVICE), torch.randn(1, 4, 16, device=DEVICE)
    before = latent_decode(q_latent, q_rope, 0.2, layer.segments())
    codes = layer.store.pool["content/codes"]
    block = int(layer.store.block_table()[0, 0])
    codes[block, 3] ^= 0xFF  # every nibble of token 3's first bytes changes
    segments = layer.segments()
    after = latent_decode(q_latent, q_rope, 0.2, segments)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, latent_decode_reference(q_latent, q_rope, 0.2, segments), rtol=1e-4, atol=1e-5)


def test_bf16_activations():
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=1, tokens=150, dtype=torch.bfloat16)
    q_latent = torch.randn(1, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    q_rope = torch.randn(1, 4, 16, device=DEVICE, dtype=torch.bfloat16)
    segments = layer.segments()
    out = latent_decode(q_latent, q_rope, 0.2, segments, dot="ieee")
    torch.testing.assert_close(out, latent_decode_reference(q_latent, q_rope, 0.2, segments), rtol=1e-3, atol=1e-4)


def test_bad_kernel_inputs_are_named_before_launch():
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=2, tokens=150)
    q_latent, q_rope = torch.randn(2, 4, 64, device=DEVICE), torch.randn(2, 4, 16, device=DEVICE)
    good = layer.segments()[0]
    cases = [
        (replace(good, block_table=good.block_table.long()), r"segments\[0\].block_table must be int32"),
        (replace(good, lengths=good.lengths[:1]), r"segments\[0\].lengths must be \(B,\)"),
        (replace(good, content=replace(good.content, bits=3)), r"segments\[0\].content.bits=3; allowed: \[0, 2, 4, 8\]"),
        (replace(good, content=replace(good.content, group=12)), r"segments\[0\].content.group=12: must be a positive divisor of d=64"),
        (replace(good, content=replace(good.content, scales=good.content.scales.transpose(0, 1))),
         r"segments\[0\].content.scales must be contiguous"),
        (replace(good, rope=replace(good.rope, data=good.rope.data.float())), r"segments\[0\].rope.data: int32 code words"),
        (replace(good, content=replace(good.content, data=torch.cat([good.content.data] * 2, -1)[..., :8])),
         r"segments\[0\].content.data must be contiguous"),
        (replace(good, content=replace(good.content, data=good.content.data.transpose(0, 1).contiguous()
                                       .transpose(0, 1))), r"segments\[0\].content.data must be contiguous"),
        (replace(good, content=replace(good.content, scales=good.content.scales.to(torch.int32))),
         r"segments\[0\].content.scales: torch.int32; allowed"),
        (replace(good, block_table=torch.cat([good.block_table] * 2, 1)[:, :1]), r"segments\[0\].block_table must be int32, "
                                                                           r"contiguous"),
        (replace(good, lengths=good.lengths.float()), r"segments\[0\].lengths must be \(B,\) = \(2,\) integers"),
    ]
    for seg, match in cases:
        with pytest.raises(ValueError, match=match):
            latent_decode(q_latent, q_rope, 0.2, [seg])
    with pytest.raises(ValueError, match=r"q_latent \(B, H, d_c\) and q_rope"):
        latent_decode(q_latent[0], q_rope, 0.2, [good])
    with pytest.raises(ValueError, match=r"q_latent and q_rope must share one dtype"):
        latent_decode(q_latent, q_rope.double(), 0.2, [good])
    with pytest.raises(ValueError, match=r"q_latent must be contiguous in its last dimension"):
        latent_decode(q_latent.transpose(1, 2).contiguous().transpose(1, 2), q_rope, 0.2, [good])
    with pytest.raises(ValueError, match=r"dot='tf32'; allowed"):
        latent_decode(q_latent, q_rope, 0.2, [good], dot="tf32")
    with pytest.raises(ValueError, match=r"block_n=24; allowed: a power of two"):
        latent_decode(q_latent, q_rope, 0.2, [good], block_n=24)
    with pytest.raises(ValueError, match=r"segments is empty"):
        latent_decode(q_latent, q_rope, 0.2, [])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("bits, symmetric, scale_dtype", [([4, 2], False, "fp16"), ([2, 16, 8, 3], True, "pow2"),
                                                          ([3, 2, 4, 2, 8, 2, 2, 16], False, "bf16")])
def test_kernel_reads_bits_per_group_of_rope_pairs(layout, bits, symmetric, scale_dtype):
    """format=pairs in both RoPE layouts, widths 2/3/4/8/16 in any order, symmetric and pow2 scales: the kernel's
    bytes-level read equals the reference (the codec's own decode) and the layer's own read."""
    from mla_quant.cache import layer_factory
    from mla_quant.quant.formats import cache_format

    cfg = OmegaConf.merge(load_quant_option("int4_joint"), {"content": {"group_size": 32},
                          "rope": {"bits": bits, "symmetric": symmetric, "scale_dtype": scale_dtype}})
    layer = layer_factory(cache_format(cfg, 96, 32, rope_layout=layout))()
    g = torch.Generator().manual_seed(len(bits))
    c, r = torch.randn(3, 190, 96, generator=g).to(DEVICE), (3 * torch.randn(3, 190, 32, generator=g)).to(DEVICE)
    valid = torch.ones(3, 190, dtype=torch.bool, device=DEVICE)
    valid[1, :9], valid[2, :77] = False, False
    layer.append(c[:, :126], r[:, :126], valid[:, :126])
    for i in range(126, 190):
        layer.append(c[:, i : i + 1], r[:, i : i + 1], valid[:, i : i + 1])
    segments = layer.segments()
    assert segments[0].rope.pairs is not None and layer.n_quantized > 0
    q, qr = torch.randn(3, 4, 96, generator=g).to(DEVICE), torch.randn(3, 4, 32, generator=g).to(DEVICE)
    out = latent_decode(q, qr, 0.1, segments, block_n=16, split_tokens=48)
    ref = latent_decode_reference(q, qr, 0.1, segments)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ref, dense_attention(layer, q, qr, 0.1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("option, override, match", [
    ("int4_joint", {"content": {"bits": 3, "group_size": 32}}, r"quant.content.bits=3.*\[2, 4, 8\].*backend=torch"),
    ("fp8_flat", {}, r"quant.content.granularity=tensor \(a scale per sequence\).*quant.backend=torch"),
])
def test_formats_the_kernel_cannot_read_are_named(option, override, match):
    cfg = OmegaConf.merge(load_quant_option(option), override, {"backend": "triton"})
    with pytest.raises(ValueError, match=match):
        cache_layer_factory(cfg, 96, 16)


def test_no_gpu_and_no_interpreter_is_a_clear_error(monkeypatch):
    import mla_quant.kernels.latent_decode  # noqa: F401 - its kernels decorated under the interpreter first

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = OmegaConf.merge(load_quant_option("int4_joint"), {"backend": "triton", "content": {"group_size": 32}})
    with pytest.raises(RuntimeError, match="no CUDA GPU.*TRITON_INTERPRET=1"):
        cache_layer_factory(cfg, 96, 16)


@pytest.mark.parametrize("option, override, cuda_decode, cpu_decode", [
    ("int4_joint", {"content": {"group_size": 32}}, "triton", CPU_DECODE),
    ("bf16", {}, "triton", CPU_DECODE),
    ("int4_joint", {"content": {"bits": 3, "group_size": 32}}, "torch", "torch"),  # a width no kernel unpacks
    ("fp8_ds_mla", {"content": {"group_size": 32}}, "triton", CPU_DECODE),  # e4m3 byte codes
    ("fp8_flat", {}, "torch", "torch"),  # a scale per sequence
    ("int4_joint", {"content": {"group_size": 32}, "rope": {"bits": [8, 4]}}, "triton", "torch"),  # pair widths
])
def test_backend_auto_picks_the_kernel_of_the_device(option, override, cuda_decode, cpu_decode):
    from mla_quant.quant.formats import cache_format

    fmt = cache_format(OmegaConf.merge(load_quant_option(option), override), 96, 16)
    assert fmt.backend == "auto"  # the default of every option
    assert fmt.step_backends("cuda") == {"prefill": "torch", "decode": cuda_decode}
    assert fmt.step_backends("cpu") == {"prefill": "torch", "decode": cpu_decode}
    forced = cache_format(OmegaConf.merge(load_quant_option("bf16"), {"backend": "torch"}), 96, 16)
    assert forced.step_backends("cuda")["decode"] == forced.step_backends("cpu")["decode"] == "torch"


def test_backend_auto_on_the_cpu_decodes_with_the_cpu_kernel(monkeypatch):
    """auto never takes the interpreter: a layer built where a GPU is visible decodes CPU tensors with the C++ CPU
    kernel, and says so; explicit triton runs the Triton kernel under the interpreter, and without it refuses CPU
    tensors by name (on a GPU its launch would fail on a CPU pointer); torch the PyTorch path (a plain layer)."""
    from mla_quant.cache.kernel import KernelLatentCacheLayer

    cfg = OmegaConf.merge(load_quant_option("int4_joint"), {"content": {"group_size": 32}, "protected": {"recent": 4}})
    assert type(cache_layer_factory(OmegaConf.merge(cfg, {"backend": "torch"}), 96, 16)()) is LatentCacheLayer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    explicit_cpu = (("cpu", "cpu"),) if HAS_CXX else ()  # backend=cpu needs the kernel built
    for backend, expected in (("auto", CPU_DECODE), ("triton", "triton"), *explicit_cpu):
        layer = cache_layer_factory(OmegaConf.merge(cfg, {"backend": backend}), 96, 16)()
        assert isinstance(layer, KernelLatentCacheLayer)
        c, r = torch.randn(2, 12, 96), torch.randn(2, 12, 16)
        if backend == "triton":
            with monkeypatch.context() as m:
                m.setenv("TRITON_INTERPRET", "0")
                with pytest.raises(ValueError, match="backend=triton decodes cuda tensors; this layer's are on cpu"):
                    layer.attend(torch.randn(2, 4, 11, 96), torch.randn(2, 4, 11, 16), c[:, :11], r[:, :11], 0.1, None)
            if os.environ.get("TRITON_INTERPRET") != "1":
                continue
            layer = cache_layer_factory(OmegaConf.merge(cfg, {"backend": backend}), 96, 16)()
        layer.attend(torch.randn(2, 4, 11, 96), torch.randn(2, 4, 11, 16), c[:, :11], r[:, :11], 0.1, None)
        layer.attend(torch.randn(2, 4, 1, 96), torch.randn(2, 4, 1, 16), c[:, 11:], r[:, 11:], 0.1, None)
        assert dict(layer.backend_steps) == {("prefill", "torch"): 1, ("decode", expected): 1}, backend


@pytest.mark.parametrize("rope", [{"quantizer": "lloyd"}, {"bits": [8, 2, 4, 16]}])
def test_triton_layer_decodes_codebooks_and_pair_widths_as_torch_does(rope):
    """quant.backend=triton with a lloyd codebook (stored in PyTorch, read by the kernel) or widths per group of
    RoPE pairs: decode steps through the kernel equal the PyTorch layer's over the same stored tokens."""
    from mla_quant.cache import layer_factory
    from mla_quant.cache.kernel import KernelLatentCacheLayer
    from mla_quant.quant.formats import cache_format

    g = torch.Generator().manual_seed(4)
    c, r = torch.randn(2, 150, 96, generator=g).to(DEVICE), (3 * torch.randn(2, 150, 16, generator=g)).to(DEVICE)
    q = torch.randn(2, 4, 1, 96, generator=g).to(DEVICE), torch.randn(2, 4, 1, 16, generator=g).to(DEVICE)
    outs = {}
    for backend in ("torch", "triton"):
        cfg = OmegaConf.merge(load_quant_option("int2_content_int4_rope"), {
            "backend": backend, "protected": {"n_sink": 2, "recent": 16},
            "content": {"group_size": 32, "quantizer": "lloyd"}, "rope": rope})
        layer = layer_factory(fitted_on(cache_format(cfg, 96, 16), c, r))()
        assert isinstance(layer, KernelLatentCacheLayer) == (backend == "triton")
        layer.append(c[:, :140], r[:, :140])
        outs[backend] = [layer.attend(*q, c[:, i : i + 1], r[:, i : i + 1], 0.1, None) for i in range(140, 143)]
        assert layer.backend_steps[("decode", backend)] == 3
    for got, want in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError,
                       match=r"quant.backend='cuda' is unknown; allowed: \['auto', 'torch', 'triton', 'cpu'\]"):
        cache_layer_factory(OmegaConf.merge(load_quant_option("int4_joint"), {"backend": "cuda"}), 96, 16)


def test_toy_model_decodes_the_same_through_the_kernel():
    """Greedy decode of the shipped toy model (batch of 2, left padding) with quant.backend=triton: the same tokens
    and logits as the PyTorch read path (a BF16 cache through the kernel: test_kernel_matches_reference). Two code
    prompts of 50 and 59 tokens: 30 and 39 of them quantized past 4 sinks and 16 recent (the interpreter runs the
    store kernel once per token, about 20 ms each)."""
    from mla_quant.tasks import code
    from mla_quant.toy.model import load_toy_model, load_toy_tokenizer

    model, tok = load_toy_model(device=DEVICE), load_toy_tokenizer()
    prompts = [r["prompt"] for r in code.test_set(2, 0)]
    enc = tok(prompts, return_tensors="pt", padding=True).to(DEVICE)
    assert (enc.attention_mask == 0).any() and enc.attention_mask.sum(1).min() > 4 + 16 + 16  # padding; quantized
    for option in ("int4_joint",):
        runs = {}
        for backend in ("torch", "triton"):
            cfg = OmegaConf.merge(load_quant_option(option),
                                  {"backend": backend, "content": {"group_size": 32}, "protected": {"recent": 16}})
            cache = quantized_cache(model, cfg)
            out = model.generate(**enc, max_new_tokens=2, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, **cache_kwargs(cache))
            runs[backend] = out
            assert cache.backends_run() == {"prefill": "torch", "decode": backend}, (option, backend)
        assert torch.equal(runs["torch"].sequences, runs["triton"].sequences), option
        torch.testing.assert_close(torch.stack(runs["triton"].scores), torch.stack(runs["torch"].scores),
                                   rtol=1e-4, atol=1e-4)


def test_bench_kernel_stage_smoke(tmp_path, monkeypatch):
    """experiment=bench_kernel runs end to end (interpreter times mean nothing; the figures come from a GPU)."""
    import json

    from conftest import compose

    from mla_quant import runner

    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: tmp_path)
    runner.main(compose(["experiment=bench_kernel", "logger=none", "task.contexts=[200]", "task.iters=1",
                           "task.warmup=0", "task.throughput_tokens=400", "task.heads=[4]", "task.d_c=64",
                           "task.d_r=16", "task.formats=[bf16,int4_joint]", "task.tune=[]",
                           "+task.quant_overrides.content.group_size=32"]))
    metrics = json.loads((tmp_path / "record.json").read_text())["metrics"]
    for mode in ("throughput", "latency"):
        case = f"bench_kernel/{mode}/h4/ctx200"
        # bfloat16 queries: float32 products on the interpreter, bfloat16 tensor-core products on a GPU (dot=auto)
        assert metrics[f"{case}/int4_joint/max_rel_err"] < (2e-2 if torch.cuda.is_available() else 1e-4)
        assert metrics[f"{case}/int4_joint/bytes_read"] < metrics[f"{case}/bf16/bytes_read"]
        assert metrics[f"{case}/bf16/speedup_vs_bf16_kernel"] == 1.0
    if not torch.cuda.is_available():  # the external peer says why it did not run
        assert metrics["bench_kernel/flashinfer"] == "not run: needs a CUDA GPU"
        assert "flashinfer: not run" in (tmp_path / "bench_kernel.md").read_text()
    rows = (tmp_path / "bench_kernel.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and "peak_share" in rows[0]
    assert (tmp_path / "bench_kernel.md").is_file() and (tmp_path / "bench_kernel.png").is_file()


def test_record_names_the_backend_of_each_step_type():
    from mla_quant.prepare import Prepared
    from mla_quant.quant.formats import cache_format

    fmt = cache_format(OmegaConf.merge(load_quant_option("int4_joint"), {"content": {"group_size": 32}}), 96, 16)
    metrics = Prepared(torch.nn.Linear(2, 2), None, {"d_c": 96, "d_r": 16}, fmt).cache_metrics()
    assert (metrics["cache/backend/prefill"], metrics["cache/backend/decode"]) == ("torch", CPU_DECODE)  # the CPU
    forced = cache_format(OmegaConf.merge(load_quant_option("int4_joint"), {"content": {"group_size": 32},
                                                                             "backend": "torch"}), 96, 16)
    metrics = Prepared(torch.nn.Linear(2, 2), None, {"d_c": 96, "d_r": 16}, forced).cache_metrics()
    assert metrics["cache/backend/decode"] == "torch"
