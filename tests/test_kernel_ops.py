"""The decode kernels as PyTorch operators (mla_quant/kernels/ops.py): each equals its kernel, passes
`torch.library.opcheck`'s schema and fake-tensor checks (a decode step traces under FakeTensorMode), and a decode
step around the C++ operator compiles with torch.compile (inductor, fullgraph: the kernel one node, no graph break)
to the eager result."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CXX
from test_kernel import ENGINE_FORMATS, FORMATS, filled_layer

from mla_quant.kernels.latent_decode import latent_decode
from mla_quant.kernels.ops import decode_op, flatten, unflatten

CASES = ["int4 g32 + int4 rope", "int4 g32 + pairs rope [8, 3, 2, 16]", "int2 g32 lloyd + int4 rope lloyd",
         "bf16 (plain layer)", "nvfp4_ds_mla: e2m1 + e4m3 scales, unscaled e4m3 rope"]
FORMATS = {**FORMATS, **ENGINE_FORMATS}


@pytest.mark.parametrize("name", CASES)
def test_operators_equal_their_kernels_and_have_fake_implementations(name):
    layer = filled_layer(dict(FORMATS[name]), d_c=96, d_r=16, batch=3, tokens=190, pads=(0, 9, 77), device="cpu")
    segments = layer.segments()
    g = torch.Generator().manual_seed(1)
    q, qr = torch.randn(3, 4, 96, generator=g), torch.randn(3, 4, 16, generator=g)
    tensors, meta = flatten(segments)
    assert flatten(unflatten(tensors, meta)) == (tensors, meta)
    assert torch.equal(decode_op("triton")(q, qr, 0.2, segments), latent_decode(q, qr, 0.2, segments))
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.mla_quant.latent_decode.default, (q, qr, 0.2, tensors, meta), test_utils=checks)
    if HAS_CXX and "pairs" not in name and name not in ENGINE_FORMATS:  # the C++ kernel: int words, one width
        from mla_quant.kernels.cpu_decode import operator_arguments

        torch.library.opcheck(torch.ops.mla_quant_cpu.latent_decode.default,
                              (q, qr, 0.2, *operator_arguments(segments)), test_utils=checks)


@pytest.mark.skipif(not HAS_CXX, reason="the C++ decode kernel did not build here")
def test_a_decode_step_around_the_cpu_operator_compiles_in_one_graph():
    from mla_quant.kernels.cpu_decode import operator_arguments

    layer = filled_layer(dict(FORMATS["int4 g32 + int4 rope"]), d_c=96, d_r=16, batch=3, tokens=190, pads=(0, 9, 77),
                         device="cpu")
    tensors, meta = operator_arguments(layer.segments())
    g = torch.Generator().manual_seed(0)
    x, w_q, w_r = torch.randn(3, 64, generator=g), torch.randn(64, 384, generator=g), torch.randn(64, 64, generator=g)
    w_o = torch.randn(384, 64, generator=g)

    def step(x, tensors):  # query projections, the kernel, the output projection: what a decode step does
        q, qr = (x @ w_q).view(3, 4, 96), (x @ w_r).view(3, 4, 16)
        o, _ = torch.ops.mla_quant_cpu.latent_decode(q, qr, 0.2, tensors, meta)
        return torch.nn.functional.silu(o.flatten(1) @ w_o)

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    torch.testing.assert_close(compiled(x, tensors), step(x, tensors), rtol=1e-5, atol=1e-5)


def test_segments_in_a_rotated_basis_through_the_operators_and_in_one_graph():
    """TurboQuant's 3-bit streams (Hadamard-rotated) beside the protected BF16 segments: through each operator (the
    rotation and the merge of the two bases around it, `in_bases`) as the reference; a decode step around the C++
    operator compiles in one graph (fullgraph) to the eager result."""
    from mla_quant.kernels.torch_decode import latent_decode_reference

    layer = filled_layer({"option": "turboquant_3bit_nc", "protected": {"n_sink": 2, "recent": 16}}, d_c=128, d_r=16,
                         batch=2, tokens=150, pads=(0, 9), device="cpu")
    segments = layer.segments()
    assert segments[0].content.rotation is not None and len(segments) == 3
    g = torch.Generator().manual_seed(2)
    q, qr = torch.randn(2, 4, 128, generator=g), torch.randn(2, 4, 16, generator=g)
    ref = latent_decode_reference(q, qr, 0.2, segments)
    torch.testing.assert_close(decode_op("triton")(q, qr, 0.2, segments), ref, rtol=1e-4, atol=1e-5)
    if HAS_CXX:
        op = decode_op("cpu")
        torch.testing.assert_close(op(q, qr, 0.2, segments), ref, rtol=1e-4, atol=1e-5)
        step = lambda q, qr: torch.nn.functional.silu(op(q, qr, 0.2, segments))  # noqa: E731
        compiled = torch.compile(step, fullgraph=True, backend="inductor")
        torch.testing.assert_close(compiled(q, qr), step(q, qr), rtol=1e-5, atol=1e-5)


def test_toy_decode_through_torch_compile_gives_the_same_tokens():
    """The toy model with the int4_joint cache (decode steps through the C++ operator where it builds), compiled
    whole with torch.compile (inductor; the cache's appends run eagerly, `torch.compiler.disable`): six greedy
    decode steps give the eager tokens, logits within 1e-4."""
    from conftest import compose

    from mla_quant.models.absorbed import cache_kwargs
    from mla_quant.prepare import prepare_model

    prep = prepare_model(compose(["experiment=quality", "quant=int4_joint"]), tokenizer=False)
    ids = torch.randint(5, 200, (2, 160), generator=torch.Generator().manual_seed(0))

    def greedy(forward):
        cache = prep.new_cache()
        with torch.no_grad():
            logits = prep.model(ids, **cache_kwargs(cache)).logits
            tokens = [logits[:, -1:].argmax(-1)]
            for _ in range(6):
                logits = forward(tokens[-1], **cache_kwargs(cache)).logits
                tokens.append(logits[:, -1:].argmax(-1))
        return torch.cat(tokens, 1), logits

    want, want_logits = greedy(prep.model)
    got, got_logits = greedy(torch.compile(prep.model, backend="inductor"))
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-4)
