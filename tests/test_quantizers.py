"""Quantizers: error within half a step (plus the stored zero's own rounding), the reference, FP8 against torch's cast,
scale storage, and bad-input errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.quant.codecs.channel_block import channel_block_dequantize, channel_block_quantize
from mla_quant.quant.codecs.fp8 import fp8_dequantize, fp8_fake_quantize, fp8_quantize
from mla_quant.quant.quantizers import (
    FP8_DTYPE,
    INT_BITS,
    SCALE_DTYPES,
    fake_quantize,
    group_dequantize,
    group_quantize,
    group_quantize_reference,
    load_scale,
    store_scale,
)


@st.composite
def grouped_inputs(draw):
    n_groups = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2, 3, 7, 8, 16, 33]))
    d = n_groups * group
    lead = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    whole = draw(st.booleans())
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0, 1000.0]))
    offset = draw(st.sampled_from([0.0, 0.5, -3.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = (torch.randn(*lead, d, generator=torch.Generator().manual_seed(seed)) + offset) * magnitude
    return x, (None if whole else group)


@settings(max_examples=80, deadline=None)
@given(
    xg=grouped_inputs(),
    bits=st.sampled_from(INT_BITS),
    symmetric=st.booleans(),
    scale_dtype=st.sampled_from(list(SCALE_DTYPES)),
)
def test_error_at_most_half_a_step(xg, bits, symmetric, scale_dtype):
    x, group_size = xg
    codes, scales, zeros = group_quantize(x, bits, group_size, symmetric, scale_dtype)
    d = x.shape[-1]
    g = 1 if group_size is None else d // group_size
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.shape == (*x.shape[:-1], g) and (zeros is None) == symmetric
    assert int(codes.max()) < 2**bits
    x_hat = group_dequantize(codes, scales, zeros, bits)
    step = load_scale(scales).repeat_interleave(d // g, dim=-1)  # the stored (rounded-up) step, per element
    bound = step / 2
    if zeros is not None:  # the zero is rounded to its own dtype: that rounding adds to the error, honestly
        exact_min = x.reshape(*x.shape[:-1], g, d // g).amin(-1)
        bound = bound + (zeros.float() - exact_min).abs().repeat_interleave(d // g, dim=-1)
    bound = bound * (1 + 1e-5) + 1e-6 * x.abs()  # float32 arithmetic
    err = (x_hat - x).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, (
        f"bits={bits} sym={symmetric} {scale_dtype} group={group_size}: error {float(err.max()):.4g} "
        f"exceeds the bound by x{worst:.4f}"
    )


@pytest.mark.parametrize("scale_dtype", list(SCALE_DTYPES))
def test_scales_rounded_up_to_the_stored_dtype(scale_dtype):
    s = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 10 + 1e-4
    stored = store_scale(s, scale_dtype)
    assert stored.dtype == SCALE_DTYPES[scale_dtype]
    back = load_scale(stored)
    assert bool((back >= s).all()), f"{scale_dtype}: {int((back < s).sum())} scales rounded down"
    if scale_dtype == "pow2":
        assert torch.equal(back, torch.exp2(torch.log2(back).round())), "pow2 scales are not powers of two"
        assert float((back / s).max()) <= 2.0
    else:
        rel = float(((back - s) / s).max())
        assert rel <= {"fp16": 2**-10, "bf16": 2**-7, "fp32": 0}[scale_dtype] * 1.0001, f"{scale_dtype}: rel {rel}"


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_matches_reference(bits, symmetric):
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(bits))
    for group_size, scale_dtype in [(8, "fp16"), (None, "bf16"), (12, "pow2"), (6, "fp32")]:
        got = group_quantize(x, bits, group_size, symmetric, scale_dtype)
        ref = group_quantize_reference(x, bits, group_size, symmetric, scale_dtype)
        assert torch.equal(got.codes, ref.codes), f"codes differ in {int((got.codes != ref.codes).sum())} places"
        assert torch.equal(got.scales, ref.scales)
        assert (got.zeros is None and ref.zeros is None) or torch.equal(got.zeros, ref.zeros)


def test_more_bits_less_error_and_dtype_kept():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(torch.bfloat16)
    errs = {}
    for bits in INT_BITS:
        x_hat = fake_quantize(x, bits, 32)
        assert x_hat.dtype == torch.bfloat16
        errs[bits] = float((x_hat.float() - x.float()).pow(2).mean() / x.float().pow(2).mean())
    assert errs[2] > errs[3] > errs[4] > errs[8], f"NMSE by bits: {errs}"
    # uniform error: NMSE ~ (range / (2^b - 1))^2 / 12 / var; int4 over groups of 32 Gaussians lands near 0.01
    assert 1e-3 < errs[4] < 3e-2, f"int4 g32 NMSE {errs[4]:.3g} is implausible"


def test_constant_and_zero_groups():
    x = torch.tensor([[2.5] * 8, [0.0] * 8])
    assert torch.equal(fake_quantize(x, 4, 4), x)  # asymmetric: the zero (fp16 2.5) carries the value exactly
    x_hat = fake_quantize(x, 4, 4, symmetric=True)
    assert torch.equal(x_hat[1], x[1])  # all-zero group stays exactly zero
    step = 2.5 / 7  # symmetric: 2.5 sits on the top level, 7 x the fp16-rounded-up step
    assert 0 < float((x_hat[0] - 2.5).abs().max()) <= 7 * step * 2**-10, f"{x_hat[0]}"


@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("scale_dtype", ["fp32", "fp16", "pow2"])
def test_fp8_matches_torch_cast(group_size, scale_dtype):
    x = torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(1)) * 3
    codes, scales, zeros = fp8_quantize(x, group_size, scale_dtype=scale_dtype)
    assert codes.dtype == FP8_DTYPE and zeros is None
    g = 1 if group_size is None else 64 // group_size
    assert scales.shape == (4, 7, g)
    s = load_scale(scales).repeat_interleave(64 // g, dim=-1)
    assert bool((x.abs().amax(-1, keepdim=True) <= 448 * s.amax(-1, keepdim=True) * (1 + 1e-6)).all())
    expected = (x / s).to(torch.float8_e4m3fn)  # torch's own round-to-nearest-even cast
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    x_hat = fp8_dequantize(codes, scales)
    assert torch.equal(x_hat, expected.float() * s)
    assert torch.equal(fp8_dequantize(codes.view(torch.uint8), scales), x_hat)
    normal = (x / s).abs() >= 2**-6  # e4m3 normal range: 3 mantissa bits, relative error <= 2^-4
    rel = ((x_hat - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= 2**-4 + 1e-6, f"fp8 rel error {float(rel.max()):.4g}"


def test_fp8_per_tensor():
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2))
    codes, scale, _ = fp8_quantize(x, per_tensor=True)
    assert scale.dim() == 0 and scale.dtype == torch.float32
    assert torch.allclose(scale, x.abs().amax() / 448)
    assert torch.equal(codes.view(torch.uint8), (x / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    # a static scale of 1.0 (vLLM's default k_scale) is a plain clamped cast
    codes1, _, _ = fp8_quantize(x * 300, per_tensor=True, scale=1.0)
    expected = (x * 300).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes1.view(torch.uint8), expected.view(torch.uint8))
    assert fp8_fake_quantize(x, per_tensor=True).dtype == x.dtype


def test_bad_inputs_name_the_value():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"bits=5.*\[2, 3, 4, 8\]"):
        group_quantize(x, 5)
    with pytest.raises(ValueError, match="group_size=3 does not divide the dimension 8"):
        group_quantize(x, 4, 3)
    with pytest.raises(ValueError, match="scale_dtype='fp8'"):
        group_quantize(x, 4, None, False, "fp8")
    with pytest.raises(ValueError, match="group_size=5 does not divide the dimension 8"):
        fp8_quantize(x, 5)
    with pytest.raises(ValueError, match="-1.0"):
        fp8_quantize(x, per_tensor=True, scale=-1.0)


# ------------------------------------------------------------------------- KIVI: per channel over blocks of tokens
def outlier_latent(tokens: int = 256, d: int = 64, seed: int = 0) -> torch.Tensor:
    """A latent whose few outlier channels are large in every token (what per-channel scales are for)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    x[:, :4] = x[:, :4] * 3 + 25 * torch.tensor([1.0, -1.0, 1.0, -1.0])
    return x


@pytest.mark.parametrize("bits", [2, 4])
def test_channel_block_round_trip_and_bound(bits):
    x = outlier_latent()
    codes, scales, zeros = channel_block_quantize(x, bits, block=32)
    assert codes.shape == x.shape and scales.shape == zeros.shape == (256 // 32, 64)
    x_hat = channel_block_dequantize(codes, scales, zeros, bits)
    # per channel and block: |x_hat - x| <= s / 2 + the zero's fp16 rounding
    step = scales.float().repeat_interleave(32, 0)
    zero_err = (zeros.float() - x.reshape(8, 32, 64).amin(1)).abs().repeat_interleave(32, 0)
    assert bool(((x_hat - x).abs() <= step / 2 + zero_err + 1e-5).all())
    again = channel_block_dequantize(*channel_block_quantize(x_hat, bits, block=32), bits)
    assert float((again - x_hat).abs().max()) < 0.51 * float(step.max())


@pytest.mark.parametrize("bits", [2, 4])
def test_channel_block_beats_per_token_rtn_on_outlier_channels(bits):
    x = outlier_latent()
    kivi = channel_block_dequantize(*channel_block_quantize(x, bits, block=32), bits)
    mse = {"kivi": float(((kivi - x) ** 2).mean())}
    for group in (None, 16):
        rtn = group_dequantize(*group_quantize(x, bits, group), bits)
        mse[f"rtn g={group}"] = float(((rtn - x) ** 2).mean())
    assert mse["kivi"] < min(v for k, v in mse.items() if k != "kivi"), mse


def test_channel_block_refuses_a_partial_block():
    with pytest.raises(ValueError, match=r"30 tokens do not fill blocks of block=32"):
        channel_block_quantize(torch.randn(30, 8), 2, 32)


def test_fake_quantize_refuses_values_its_zeros_cannot_hold():
    """|x| ~ 1e5 overflows fp16 zeros (max 65504): refused by name, as the cache refuses it, instead of inf."""
    x = torch.tensor([[1e5, -1e5, 3.0, 4.0]])
    with pytest.raises(ValueError, match=r"zeros overflow scale_dtype=fp16 \(max \|x\| = 1e\+05\).*scale_dtype=fp32"):
        fake_quantize(x, 4, None, False, "fp16")
    out = fake_quantize(x, 4, None, False, "fp32")
    assert bool(torch.isfinite(out).all()) and float((out - x).abs().max()) <= 2e5 / 15 / 2 + 1


@pytest.mark.parametrize("bits,group", [(2, 16), (2, None), (3, 8), (4, 16), (8, None)])
@pytest.mark.parametrize("quantizer", ["clip", "hqq"])
def test_searched_quantizers_never_lose_to_rtn(bits, group, quantizer):
    """clip and hqq keep every group at least as well reconstructed as RTN (its range is a candidate), with the same
    stored layout; at 2 bits on heavy-tailed groups they are clearly better."""
    from mla_quant.quant.quantizers import group_dequantize, group_quantize

    g = torch.Generator().manual_seed(bits * 7 + (group or 0))
    x = torch.randn(64, 48, generator=g) * torch.exp(torch.randn(48, generator=g))
    ref = group_quantize(x, bits, group, False, "fp16", "rtn")
    got = group_quantize(x, bits, group, False, "fp16", quantizer)
    assert got.codes.dtype == ref.codes.dtype and got.scales.shape == ref.scales.shape
    assert got.zeros.shape == ref.zeros.shape and got.zeros.dtype == ref.zeros.dtype
    assert int(got.codes.max()) < 2**bits

    def group_err(q):
        xh = group_dequantize(q.codes, q.scales, q.zeros, bits)
        return (xh - x).pow(2).reshape(64, -1, group or 48).sum(-1)

    assert bool((group_err(got) <= group_err(ref) * (1 + 1e-6) + 1e-12).all())
    if bits == 2:
        gain = float(group_err(ref).sum() / group_err(got).sum())
        assert gain > (1.3 if quantizer == "clip" else 1.02), gain


def test_clip_has_a_symmetric_form_and_bad_quantizers_are_refused():
    from mla_quant.quant.quantizers import group_dequantize, group_quantize

    x = torch.randn(32, 64) ** 3
    ref = group_quantize(x, 2, 16, True, "fp16", "rtn")
    got = group_quantize(x, 2, 16, True, "fp16", "clip")
    err = [float((group_dequantize(q.codes, q.scales, None, 2) - x).pow(2).sum()) for q in (ref, got)]
    assert got.zeros is None and err[1] < err[0]
    with pytest.raises(ValueError, match=r"quantizer='gptq'; allowed: \['rtn', 'clip', 'hqq', 'lloyd'\]"):
        group_quantize(x, 2, 16, False, "fp16", "gptq")
    with pytest.raises(ValueError, match="hqq optimizes each group's zero point: it needs symmetric=false"):
        group_quantize(x, 2, 16, True, "fp16", "hqq")


@pytest.mark.parametrize("bits,group", [(2, 16), (2, None), (3, 8), (4, 16), (4, None)])
def test_lloyd_levels_reconstruct_the_fitted_values_better_than_rtn(bits, group):
    """fit_levels: 2^bits ascending levels in code units; the values they were fitted on, stored with them, are
    reconstructed at least as well as with clip (each fitting step descends from clip's ranges at RTN's grid), and
    clearly better than RTN on heavy-tailed values; the codes, scales and zeros have RTN's layout, and fake_quantize reads back levels[q] s + z."""
    from mla_quant.quant.quantizers import fit_levels, group_dequantize, group_quantize

    g = torch.Generator().manual_seed(bits * 11 + (group or 0))
    x = torch.distributions.Laplace(0.0, 1.0).sample((256, 48)) * torch.exp(torch.randn(48, generator=g))
    levels = fit_levels(x, bits, group)
    assert levels.shape == (2**bits,) and levels.dtype == torch.float32 and bool((levels[1:] > levels[:-1]).all())
    ref = group_quantize(x, bits, group)
    got = group_quantize(x, bits, group, quantizer="lloyd", levels=levels)
    assert got.codes.dtype == torch.uint8 and int(got.codes.max()) < 2**bits
    assert got.scales.shape == ref.scales.shape and got.zeros.shape == ref.zeros.shape
    x_hat = group_dequantize(got.codes, got.scales, got.zeros, bits, levels=levels)
    step = got.scales.float().repeat_interleave(group or 48, -1)
    zero = got.zeros.float().repeat_interleave(group or 48, -1)
    torch.testing.assert_close(x_hat, levels[got.codes.long()] * step + zero, rtol=0, atol=0)
    assert torch.equal(fake_quantize(x, bits, group, quantizer="lloyd", levels=levels), x_hat)
    err = float((x_hat - x).pow(2).sum())
    rtn = float((group_dequantize(*ref, bits) - x).pow(2).sum())
    clip = float((group_dequantize(*group_quantize(x, bits, group, quantizer="clip"), bits) - x).pow(2).sum())
    assert err <= clip * (1 + 1e-6) and clip <= rtn
    if bits == 2:
        assert rtn / err > 1.5, (rtn, err)
    # Without levels, fake_quantize fits them on the values it is given (a study's quantizer)
    assert torch.equal(fake_quantize(x, bits, group, quantizer="lloyd"), x_hat)


def test_lloyd_with_uniform_levels_is_the_clip_search():
    """At RTN's levels 0 .. 2^b - 1 a lloyd path is clip's range search (the same candidates, nearest level =
    rounding), so the codebook alone is what lloyd adds."""
    from mla_quant.quant.quantizers import group_dequantize, group_quantize

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)) ** 3
    uniform = torch.arange(4, dtype=torch.float32)
    got = group_quantize(x, 2, 16, quantizer="lloyd", levels=uniform)
    clip = group_quantize(x, 2, 16, quantizer="clip")
    torch.testing.assert_close(group_dequantize(*got, 2, levels=uniform), group_dequantize(*clip, 2), rtol=0,
                               atol=1e-6)


def test_lloyd_refuses_what_it_cannot_take():
    from mla_quant.quant.formats import PathFormat
    from mla_quant.quant.quantizers import fit_levels, group_quantize

    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="lloyd places levels inside each group's range: it needs symmetric=false"):
        group_quantize(x, 2, 16, True, "fp16", "lloyd")
    with pytest.raises(ValueError, match=r"quantizer=lloyd fits bits in \[2, 3, 4\]; got bits=8"):
        fit_levels(x, 8)
    with pytest.raises(ValueError, match=r"a codebook of 3 levels for bits=2; allowed: 4 levels"):
        group_quantize(x, 2, 16, quantizer="lloyd", levels=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="not finite and strictly ascending"):
        group_quantize(x, 2, 16, quantizer="lloyd", levels=torch.tensor([0.0, 2.0, 1.0, 3.0]))
    with pytest.raises(ValueError, match="levels are the codebook of quantizer=lloyd; quantizer=rtn takes none"):
        group_quantize(x, 2, 16, levels=torch.arange(4.0))
    with pytest.raises(ValueError, match=r"quant.rope.quantizer=lloyd fits non-uniform levels at bits \[2, 3, 4\]"):
        PathFormat.from_cfg({"format": "int", "bits": 8, "quantizer": "lloyd"}, "quant.rope")
    with pytest.raises(ValueError, match="format=pairs .* takes rtn, clip or hqq"):
        PathFormat.from_cfg({"bits": [4, 2], "quantizer": "lloyd"}, "quant.rope")
    with pytest.raises(ValueError, match=r"quant.rope codebook: a codebook of 4 levels for bits=4; allowed: 16"):
        PathFormat(format="int", bits=4, quantizer="lloyd", levels=(0.0, 1.0, 2.0, 3.0)).check(64, "quant.rope")
    with pytest.raises(ValueError, match="unknown key"):  # levels are fitted, never configured
        PathFormat.from_cfg({"format": "int", "bits": 2, "quantizer": "lloyd", "levels": [0, 1, 2, 3]})
