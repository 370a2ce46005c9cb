"""Host reads (device values read on the host: a stream sync on a GPU, and what CUDA graph capture refuses) of a
decode step, counted with `mla_quant.audit.HostReads` on a tiny two-layer DeepSeek-V3 with the int4_joint cache,
through the PyTorch layer and through backend=auto (the C++ kernel here, the Triton kernel on a GPU). The steady
decode step's reads are listed with their reasons; a new one fails the test. Without an attention mask a steady
step reads nothing."""

from __future__ import annotations

import pytest
import torch
from test_quant_cache import TINY, compose, quant_cfg

from mla_quant.audit import HostReads
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.prepare import build_model

READ = "_local_scalar_dense"
# What a steady decode step still reads, per step and per MLA layer, and why.
PER_STEP = {
    # the mask hook asks whether any row is padded: if none is, every layer runs without a mask
    (READ, "absorbed.py:latent_mask"): 1,
}
PER_LAYER_PADDED = {
    # the decode kernel serves a step only if its mask hides padding slots and nothing else: the mask is compared
    # with the slots the cache marked as padding
    (READ, "reads.py:_hides_only_padding"): 1,
    # the ring-buffer fast path of append takes a step whose new token is real in every row
    (READ, "layer.py:append"): 1,
}


@pytest.fixture(scope="module")
def model():
    return build_model(compose("model=tiny_deepseek_v3").model)


def _steady_reads(model, backend: str, mask_kind: str) -> list[HostReads]:
    ids = torch.randint(5, 500, (2, 52), generator=torch.Generator().manual_seed(0))
    cache = quantized_cache(model, quant_cfg("int4_joint", *TINY, f"quant.backend={backend}"))
    mask = torch.ones(2, 48, dtype=torch.long)
    if mask_kind == "padded":
        mask[1, :9] = 0
    reads = []
    with torch.no_grad():
        model(ids[:, :48], **({} if mask_kind == "none" else {"attention_mask": mask}), **cache_kwargs(cache))
        for i in range(48, 52):  # the first step after a prefill settles the regions; the later ones are steady
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            with HostReads() as r:
                model(ids[:, i:i + 1], **({} if mask_kind == "none" else {"attention_mask": mask}),
                      **cache_kwargs(cache))
            reads.append(r)
    return reads[1:]


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("mask_kind", ["none", "ones", "padded"])
def test_steady_decode_step_reads_only_the_listed_places(model, backend, mask_kind):
    layers = model.config.num_hidden_layers
    want = {} if mask_kind == "none" else dict(PER_STEP)
    if mask_kind == "padded":
        want.update({site: n * layers for site, n in PER_LAYER_PADDED.items()})
    for step in _steady_reads(model, backend, mask_kind):
        assert dict(step.sites) == want, (backend, mask_kind, dict(step.sites))


def test_host_reads_are_seen():
    """The counter sees .item(), bool() and nonzero (a negative control for the assertions above)."""
    x = torch.arange(4)
    with HostReads() as r:
        x.sum().item()
        bool(x.all())
        x.nonzero()
    assert r.count == 3
