"""The torch read path's decoded view (`LatentCacheLayer._sync_view`): what a decode step reads equals decoding the
whole cache afresh, after appends with padding, crops and batch edits, for every kind of format; and a decode step
decodes only the tokens stored since the previous read."""

from __future__ import annotations

import pytest
import torch

from mla_quant.cache.layer import LatentCacheLayer
from mla_quant.quant.formats import PathFormat
from test_kernel import filled_layer

OPTIONS = ["unquantized", "bf16", "int4_joint", "int2_content_int4_rope", "fp8_flat", "fp8_ds_mla"]


def _layer(option: str, tokens: int = 120):
    if option == "unquantized":
        layer = LatentCacheLayer()
        g = torch.Generator().manual_seed(0)
        valid = torch.ones(3, tokens, dtype=torch.bool)
        valid[1, :7] = valid[2, :50] = False
        layer.append(torch.randn(3, tokens, 64, generator=g), torch.randn(3, tokens, 16, generator=g), valid)
        return layer
    quant = {"option": option, "protected": {"n_sink": 2, "recent": 10}}
    if option != "fp8_flat":
        quant["content"] = {"group_size": 32}
    return filled_layer(quant, d_c=64, d_r=16, batch=3, tokens=tokens, pads=(0, 7, 50))


def _assert_view_is_a_fresh_decode(layer):
    view, lengths = layer.read_compact()
    fresh, fresh_lengths = layer._decode_all(layer.dtype)
    assert torch.equal(lengths, fresh_lengths)
    for p in view:
        for b, n in enumerate(lengths.tolist()):
            assert torch.equal(view[p][b, :n], fresh[p][b, :n]), (p, b)


@pytest.mark.parametrize("option", OPTIONS)
def test_view_equals_a_fresh_decode(option):
    layer = _layer(option)
    _assert_view_is_a_fresh_decode(layer)
    g = torch.Generator().manual_seed(1)
    for step in range(25):  # decode steps, one sequence padded at some of them
        valid = torch.tensor([[True], [step % 3 != 0], [True]])
        layer.append(torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 16, generator=g), valid)
        if step % 4 == 0:
            _assert_view_is_a_fresh_decode(layer)
    layer.crop(-9)
    _assert_view_is_a_fresh_decode(layer)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    _assert_view_is_a_fresh_decode(layer)
    layer.batch_select_indices(torch.tensor([0, 2]))
    layer.append(torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 16, generator=g))
    _assert_view_is_a_fresh_decode(layer)


def test_a_decode_step_decodes_only_new_tokens(monkeypatch):
    layer = _layer("int4_joint", tokens=300)
    layer.read()
    decoded = []
    original = PathFormat.decode

    def counting(self, parts, *args, **kwargs):
        decoded.append(next(iter(parts.values())).shape[0])
        return original(self, parts, *args, **kwargs)

    monkeypatch.setattr(PathFormat, "decode", counting)
    for _ in range(5):
        layer.append(torch.randn(3, 1, 64), torch.randn(3, 1, 16))
        layer.read()
    assert decoded and max(decoded) <= 3  # one token per sequence leaves the recent window per step
