"""The decode kernel's single stage-1 launch over every segment and its Triton merge: each format x head count x odd
length x protected region (none, some) x padding against the reference and against an independent float64
attention; the split plan; segments without tokens; more segments than one launch reads; bf16 products on a GPU."""

from __future__ import annotations

import pytest
import torch

from mla_quant.kernels.decode_plan import merge_heads, split_plan
from mla_quant.kernels.latent_decode import Segment, latent_decode
from mla_quant.kernels.torch_decode import latent_decode_reference
from test_kernel import DEVICE, FORMATS, dense_attention, filled_layer

SHAPES = {1: (96, 16), 16: (96, 16), 128: (32, 8)}  # heads -> (d_c, d_r); 128 heads with small dims
PROTECTED = {"none": {"n_sink": 0, "recent": 0}, "sinks+recent": {"n_sink": 3, "recent": 20}}


# A launch tiles the heads the same way with or without protected segments: one head (a padded head block) over the
# one segment, 16 and 128 heads over three (test_kernel.py checks every format at 1 and 20 heads as well)
LAUNCHES = [(1, "none"), (16, "sinks+recent"), (128, "sinks+recent")]


@pytest.mark.parametrize(("heads", "protected"), LAUNCHES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_one_launch_matches_reference(name, heads, protected):
    d_c, d_r = SHAPES[heads]
    quant = dict(FORMATS[name])
    bf16 = quant.get("option") == "bf16"
    if not bf16:
        quant["protected"] = PROTECTED[protected]
        if d_c % quant["content"].get("group_size", 1):
            quant["content"] = {**quant["content"], "group_size": 16}
    elif protected != "none" and heads != 128:  # at 128 heads its one launch is checked here (LAUNCHES)
        pytest.skip("a bf16 cache protects nothing")
    layer = filled_layer(quant, d_c=d_c, d_r=d_r, batch=3, tokens=147, pads=(0, 13, 70), seed=heads)
    segments = layer.segments()
    assert len(segments) == (1 if bf16 or protected == "none" else 3)
    g = torch.Generator().manual_seed(3)
    q_latent = torch.randn(3, heads, d_c, generator=g).to(DEVICE)
    q_rope = torch.randn(3, heads, d_r, generator=g).to(DEVICE)
    ref = latent_decode_reference(q_latent, q_rope, 0.15, segments)
    odd = [{"split_tokens": 37, "block_n": 16}] if heads < 128 else []  # many odd splits (the same at any head count)
    for kwargs in ({}, *odd):  # the planned splits
        out = latent_decode(q_latent, q_rope, 0.15, segments, **kwargs)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5, msg=lambda m: f"{name}, {kwargs}: {m}")
    torch.testing.assert_close(ref, dense_attention(layer, q_latent, q_rope, 0.15), rtol=0, atol=1e-5)


def _dense(batch: int, width: int, lengths: list[int], d_c: int = 64, d_r: int = 16, seed: int = 0) -> Segment:
    g = torch.Generator().manual_seed(seed)
    c, r = torch.randn(batch, width, d_c, generator=g), torch.randn(batch, width, d_r, generator=g)
    return Segment.dense(c.to(DEVICE), r.to(DEVICE), torch.tensor(lengths, device=DEVICE))


def test_sequences_and_segments_without_tokens():
    """A segment empty for one sequence, a segment empty for all, a sequence with no token at all (output 0)."""
    segments = [_dense(3, 40, [39, 0, 0], seed=1), _dense(3, 5, [0, 0, 0], seed=2), _dense(3, 9, [1, 9, 0], seed=3)]
    q_latent, q_rope = torch.randn(3, 4, 64, device=DEVICE), torch.randn(3, 4, 16, device=DEVICE)
    out = latent_decode(q_latent, q_rope, 0.2, segments, split_tokens=16)
    torch.testing.assert_close(out, latent_decode_reference(q_latent, q_rope, 0.2, segments), rtol=0, atol=1e-5)
    assert out[2].abs().max() == 0


def test_any_number_of_segments_in_one_launch():
    segments = [_dense(2, 7 + 3 * i, [5 + i, 7 + 2 * i], seed=i) for i in range(5)]
    q_latent, q_rope = torch.randn(2, 3, 64, device=DEVICE), torch.randn(2, 3, 16, device=DEVICE)
    out = latent_decode(q_latent, q_rope, 0.3, segments)
    torch.testing.assert_close(out, latent_decode_reference(q_latent, q_rope, 0.3, segments), rtol=0, atol=1e-5)


def test_split_plan_fills_the_sms():
    (tps, n), = split_plan(1, 1, [131072], block_n=32, num_sms=132)
    assert 240 <= n <= 264 and tps % 32 == 0 and tps * n >= 131072  # batch 1: about two waves of whole-tile splits
    (tps, n), = split_plan(256, 1, [4096], block_n=32, num_sms=132)
    assert n == 2  # a large batch fills the GPU by itself (rounded up to whole waves)
    assert split_plan(1, 8, [65536, 4, 128], block_n=32, num_sms=132)[1:] == [(32, 1), (128, 1)]  # protected: 1
    assert split_plan(4, 1, [100], block_n=32, num_sms=132, split_tokens=48) == [(48, 3)]


def test_merge_tiles_heads_while_the_programs_fill_the_sms():
    assert merge_heads(64, 128, 132) == 8  # a large batch: FlashMLA's 8 heads per program
    assert merge_heads(1, 128, 132) == 1 and merge_heads(1, 16, 132) == 1  # batch 1: a program per head
    assert merge_heads(3, 128, 132) == 2  # 3 x 64 programs >= 132; 3 x 32 would not be
    assert merge_heads(3, 20, 1) == 8 and merge_heads(2, 3, 1) == 4 and merge_heads(2, 1, 1) == 1  # one "SM"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_bf16_products_on_gpu(heads):
    """dot='bf16' (bfloat16 operands, float32 accumulation; the default for bfloat16 queries on a GPU) stays within
    bfloat16 rounding of the float32 reference at DeepSeek's dims."""
    layer = filled_layer({"content": {"group_size": 64}}, d_c=512, d_r=64, batch=2, tokens=1500,
                         dtype=torch.bfloat16, pads=(0, 100))
    segments = layer.segments()
    q_latent = torch.randn(2, heads, 512, device=DEVICE, dtype=torch.bfloat16)
    q_rope = torch.randn(2, heads, 64, device=DEVICE, dtype=torch.bfloat16)
    ref = latent_decode_reference(q_latent, q_rope, 576 ** -0.5, segments)
    for dot, tol in (("ieee", 1e-4), ("bf16", 2e-2)):
        out = latent_decode(q_latent, q_rope, 576 ** -0.5, segments, dot=dot)
        err = (out - ref).abs().max().item() / ref.abs().max().item()
        assert err < tol, (dot, err)


def test_bf16_products_rounding():
    """dot='bf16' rounds the operands to bfloat16 and accumulates in float32 (on the CPU interpreter emulated with
    float32 products of the rounded operands): within bfloat16 rounding of the exact result, and not equal to it."""
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=2, tokens=150, pads=(0, 20))
    segments = layer.segments()
    q_latent, q_rope = torch.randn(2, 16, 64, device=DEVICE), torch.randn(2, 16, 16, device=DEVICE)
    ref = latent_decode_reference(q_latent, q_rope, 0.2, segments)
    out = latent_decode(q_latent, q_rope, 0.2, segments, dot="bf16")
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert 1e-6 < err < 2e-2
