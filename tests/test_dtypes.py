"""bfloat16 and float16 end to end on the CPU (slow there, but the same code a GPU runs): every cache format stores
and reads latents of those dtypes as it does their float32 values, and a float16 tiny model with a cache decodes
within float16 rounding of the float32 one."""

from __future__ import annotations

import pytest
import torch
from test_quant_cache import OPTIONS, TINY, compose, quant_cfg

from mla_quant.cache import cache_layer_factory
from mla_quant.models.absorbed import cache_kwargs, new_cache, quantized_cache
from mla_quant.prepare import build_model

DTYPES = [torch.bfloat16, torch.float16]


def _filled(quant, content, rope, valid):
    layer = cache_layer_factory(quant, content.shape[-1], rope.shape[-1])()
    first = content.shape[1] - 12
    layer.append(content[:, :first], rope[:, :first], valid[:, :first])  # a prefill, then decode appends
    for i in range(first, content.shape[1]):
        layer.append(content[:, i:i + 1], rope[:, i:i + 1], valid[:, i:i + 1])
    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "mixed"])
def test_every_format_stores_and_reads_half_precision_latents(option, dtype):
    """Latents in `dtype` are stored as their float32 values are (the encoders work in float32) and read back in
    `dtype`: the read equals the float32 layer's read rounded to `dtype`, real slot for slot, through the PyTorch
    layer and the layer quant.backend=auto builds."""
    g = torch.Generator().manual_seed(0)
    content = torch.randn(2, 200, 512, generator=g).to(dtype)
    rope = (3 * torch.randn(2, 200, 64, generator=g)).to(dtype)
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[1, :17] = False
    for backend in ("torch", "auto"):
        quant = quant_cfg(option, f"quant.backend={backend}")
        ref = _filled(quant, content.float(), rope.float(), valid)
        got = _filled(quant, content, rope, valid)
        (c32, r32), (c, r) = ref.read_stored(), got.read_stored()
        real = ref.slot_valid
        assert c.dtype == r.dtype == dtype, (option, backend, c.dtype)
        assert torch.equal(c[real], c32[real].to(dtype)) and torch.equal(r[real], r32[real].to(dtype)), (option,
                                                                                                         backend)


def _decode_logits(model, quant, ids, prompt: int = 32):
    cache = new_cache(model) if quant is None else quantized_cache(model, quant)
    with torch.no_grad():
        out = [model(ids[:, :prompt], **cache_kwargs(cache)).logits.float()]
        for i in range(prompt, ids.shape[1]):  # decode steps, teacher-forced
            out.append(model(ids[:, i:i + 1], **cache_kwargs(cache)).logits.float())
    return torch.cat(out, 1)


def test_float16_model_decodes_within_rounding_of_float32():
    """A tiny model in float16 with the unquantized cache, the bf16 format and int8 on both paths: prefill and
    decode logits within 5e-3 (relative, unquantized) and 1e-2 (int8) of the float32 model with the same cache
    (measured 1.6e-3 and 3.7e-3; coarser formats flip rounding boundaries, so their gap says little). In bfloat16
    the bf16 format equals the unquantized cache exactly."""
    cfg = compose("model=tiny_deepseek_v3")
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    m32, m16 = build_model(cfg.model, dtype="float32"), build_model(cfg.model, dtype="float16")
    for quant, tol in ((None, 5e-3), (quant_cfg("bf16"), 5e-3), (quant_cfg("int8_joint", *TINY), 1e-2)):
        ref, got = _decode_logits(m32, quant, ids), _decode_logits(m16, quant, ids)
        assert float((got - ref).norm() / ref.norm()) < tol, quant
    mbf = build_model(cfg.model, dtype="bfloat16")
    assert torch.equal(_decode_logits(mbf, quant_cfg("bf16"), ids), _decode_logits(mbf, None, ids))
