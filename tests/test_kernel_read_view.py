"""The torch read path (`StoredKeys`): what an attention step reads block by block from the stored tensors equals the
whole cache decoded afresh (`read_stored`), slot for slot, after appends with padding, crops and batch edits, for
every kind of format; attention over it equals attention over the decoded tensors; and the cache holds no decoded
copy between steps."""

from __future__ import annotations

import pytest
import torch

from mla_quant.cache.layer import LatentCacheLayer
from mla_quant.cache.reads import StoredKeys
from mla_quant.kernels.attention import AttentionBlocks, CausalMask, latent_attention
from test_kernel import filled_layer

OPTIONS = ["unquantized", "bf16", "int4_joint", "int2_content_int4_rope", "fp8_flat", "fp8_ds_mla", "kivi_int2"]


def _layer(option: str, tokens: int = 120):
    if option == "unquantized":
        layer = LatentCacheLayer()
        g = torch.Generator().manual_seed(0)
        valid = torch.ones(3, tokens, dtype=torch.bool)
        valid[1, :7] = valid[2, :50] = False
        layer.append(torch.randn(3, tokens, 64, generator=g), torch.randn(3, tokens, 16, generator=g), valid)
        return layer
    quant = {"option": option, "protected": {"n_sink": 2, "recent": 10}}
    if option not in ("fp8_flat", "kivi_int2"):
        quant["content"] = {"group_size": 32}
    return filled_layer(quant, d_c=64, d_r=16, batch=3, tokens=tokens, pads=(0, 7, 50), device="cpu")


def _assert_blocks_are_a_fresh_decode(layer, block: int = 7):
    """Every block of slots StoredKeys decodes equals those slots of the full decode, real slots exactly."""
    keys = StoredKeys(layer)
    full_c, full_r = layer.read_stored()
    real = layer.slot_valid
    for k0 in range(0, keys.length, block):
        k1 = min(keys.length, k0 + block)
        c, r = keys(k0, k1)
        ok = real[:, k0:k1]
        assert torch.equal(c[ok], full_c[:, k0:k1][ok]) and torch.equal(r[ok], full_r[:, k0:k1][ok]), (k0, k1)


@pytest.mark.parametrize("option", OPTIONS)
def test_blocks_equal_a_fresh_decode(option):
    layer = _layer(option)
    _assert_blocks_are_a_fresh_decode(layer)
    g = torch.Generator().manual_seed(1)
    for step in range(25):  # decode steps, one sequence padded at some of them
        valid = torch.tensor([[True], [step % 3 != 0], [True]])
        layer.append(torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 16, generator=g), valid)
        if step % 4 == 0:
            _assert_blocks_are_a_fresh_decode(layer, block=5 + step)
    layer.crop(-9)
    _assert_blocks_are_a_fresh_decode(layer)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    _assert_blocks_are_a_fresh_decode(layer)
    layer.batch_select_indices(torch.tensor([0, 2]))
    layer.append(torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 16, generator=g))
    _assert_blocks_are_a_fresh_decode(layer, block=64)


@pytest.mark.parametrize("option", ["int4_joint", "kivi_int2", "unquantized"])
@pytest.mark.parametrize("key_block", [16, 2048])
def test_attention_over_blocks_equals_attention_over_the_decoded_cache(option, key_block):
    """A decode step (one query per sequence) over keys decoded `key_block` at a time, merged by the online softmax,
    and a prefill-sized step: the output of attention over `read_stored`'s tensors, to float32 rounding."""
    layer = _layer(option)
    g = torch.Generator().manual_seed(2)
    blocks = AttentionBlocks(query=4, key=key_block)
    mask = CausalMask(layer.slot_valid)
    for t in (1, 9):
        q, qr = torch.randn(3, 4, t, 64, generator=g), torch.randn(3, 4, t, 16, generator=g)
        c, r = layer.read_stored()
        mask = CausalMask(layer.slot_valid)
        want = latent_attention(q, qr, c, r, 0.1, mask, blocks=blocks)
        got = latent_attention(q, qr, StoredKeys(layer), None, 0.1, mask, blocks=blocks)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (t, key_block)


def test_the_cache_keeps_no_decoded_copy():
    """After attention steps the layer holds its stored tensors and protected buffers only: its tensors' bytes
    are held_bytes (plus the per-slot validity), whatever was decoded during the steps."""
    layer = _layer("int4_joint", tokens=300)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        q, qr = torch.randn(3, 4, 1, 64, generator=g), torch.randn(3, 4, 1, 16, generator=g)
        layer.attend(q, qr, torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 16, generator=g), 0.1, None)
    tensors = {id(t): t for t in _tensors(layer)}
    held = sum(t.numel() * t.element_size() for t in tensors.values() if t.is_floating_point() or t.dtype in
               (torch.uint8, torch.int32, torch.int8))
    assert held <= layer.held_bytes() + 3 * 8 * 4, (held, layer.held_bytes())


def _tensors(obj, depth=0):
    """Every tensor reachable from the layer's attributes (dicts, lists, the paged store)."""
    if torch.is_tensor(obj):
        yield obj
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            if k not in ("_views", "_table", "fmt"):  # views of the pool, the block table (int32 per block)
                yield from _tensors(v, depth + 1)
