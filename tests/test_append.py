"""The steady-state decode append (the oldest window token leaves into the store, the new one takes its slot in the
window's ring, the tokens about to leave quantized together ahead of time) stores and reads exactly what the general append stores
and reads, for every kind of format, with padding (in the prefill, and as a decode step's new token) and past the
point where sinks and window fill."""

import pytest
import torch

from mla_quant.cache import LatentCacheLayer, cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
from mla_quant.kernels.attention import latent_attention
from omegaconf import OmegaConf

D_C, D_R = 96, 16


@pytest.mark.parametrize("option", ["int4_joint", "int2_content_int4_rope", "fp8_flat", "fp8_ds_mla", "kivi_int2",
                                    "int2_joint+hqq", "int2_joint+clip"])
def test_fast_append_equals_the_general_append(option, monkeypatch):
    option, _, quantizer = option.partition("+")
    quantizers = {p: {"quantizer": quantizer} for p in ("content", "rope")} if quantizer else {}
    cfg = OmegaConf.merge(load_quant_option(option, groups={"wide": 32, "narrow": 32}),
                          {"protected": {"n_sink": 3, "recent": 9}, "block_size": 8}, quantizers)
    fast, slow = cache_layer_factory(cfg, D_C, D_R)(), cache_layer_factory(cfg, D_C, D_R)()
    slow.fast_append = False
    steady = []
    original = LatentCacheLayer._steady
    monkeypatch.setattr(LatentCacheLayer, "_steady", lambda self, w: steady.append(original(self, w)) or steady[-1])
    g = torch.Generator().manual_seed(0)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :4] = False  # left padding in the prefill
    steps = [(torch.randn(2, 7, D_C, generator=g), torch.randn(2, 7, D_R, generator=g), valid)]
    # decode steps: all real (no validity given, or given), and padding tokens in one row or the other (a steady
    # step leaves that row's regions as they were, decided on the device)
    marks = {2: [True, False], 4: [False, True], 0: [True, True]}
    steps += [(torch.randn(2, 1, D_C, generator=g), torch.randn(2, 1, D_R, generator=g),
               None if i % 6 not in marks else torch.tensor(marks[i % 6])[:, None]) for i in range(60)]
    for i, (c, r, v) in enumerate(steps):
        if i in (25, 36):  # mid-stage: a crop, then a batch reorder, before more steady steps
            for layer in (fast, slow):
                layer.crop(-2) if i == 25 else layer.reorder_cache(torch.tensor([1, 0]))
        q, qr = torch.randn(2, 2, c.shape[1], D_C, generator=g), torch.randn(2, 2, c.shape[1], D_R, generator=g)
        a = fast.attend(q, qr, c, r, 0.1, None, v)
        b = slow.attend(q, qr, c, r, 0.1, None, v)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the ring's window in another order: the same sum
        for x, y in zip(fast.read(), slow.read()):
            assert torch.equal(x, y)
        assert (fast.n_quantized, fast.nbytes()) == (slow.n_quantized, slow.nbytes())
        # Held beside: at most the block each sequence takes one step early for tokens written before they leave the
        # window (into a block the general path takes at the next step).
        ahead = fast.held_bytes() - slow.held_bytes()
        assert 0 <= ahead <= 2 * sum(p.shape[1] for p in fast.store.pages.values())
    took = any(steady) if option != "kivi_int2" else not any(steady)  # KIVI's token blocks take the general path
    assert took and fast.n_quantized > 0


def test_fast_append_matches_attention_over_the_reference(monkeypatch):
    """After many steady steps, attention over the cache equals attention over the stored values read back."""
    cfg = OmegaConf.merge(load_quant_option("int4_joint", groups={"wide": 32, "narrow": 32}),
                          {"protected": {"n_sink": 2, "recent": 5}})
    layer = cache_layer_factory(cfg, D_C, D_R)()
    g = torch.Generator().manual_seed(1)
    layer.append(torch.randn(1, 6, D_C, generator=g), torch.randn(1, 6, D_R, generator=g))
    for _ in range(20):
        layer.append(torch.randn(1, 1, D_C, generator=g), torch.randn(1, 1, D_R, generator=g))
    q, qr = torch.randn(1, 2, 1, D_C, generator=g), torch.randn(1, 2, 1, D_R, generator=g)
    c, r = layer.read()
    want = latent_attention(q, qr, c, r, 0.1, None)
    got = layer.attend(q, qr, c[:, :0], r[:, :0], 0.1, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
