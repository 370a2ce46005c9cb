"""Host reads (device values read on the host: a stream sync on a GPU, and what CUDA graph capture refuses) of a
decode step, counted with `mla_quant.audit.HostReads` on a tiny two-layer DeepSeek-V3 with the int4_joint cache,
through the PyTorch layer, backend=auto (the C++ kernel here, the Triton kernel on a GPU) and backend=triton. A steady
decode step reads nothing, with or without an attention mask, padded batch or not."""

from __future__ import annotations

import pytest
import torch
from test_quant_cache import TINY, compose, quant_cfg

from mla_quant.audit import HostReads
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.prepare import build_model

@pytest.fixture(scope="module")
def model():
    return build_model(compose("model=tiny_deepseek_v3").model)


def _steady_reads(model, backend: str, mask_kind: str) -> list[HostReads]:
    """The host reads of each decode step after the first (which settles the regions after the prefill), over 24
    steps: the window's tokens are staged into the pages every few steps; in the padded batch one step's new token is
    padding in one row."""
    steps = 24
    ids = torch.randint(5, 500, (2, 48 + steps), generator=torch.Generator().manual_seed(0))
    cache = quantized_cache(model, quant_cfg("int4_joint", *TINY, f"quant.backend={backend}"))
    mask = torch.ones(2, 48, dtype=torch.long)
    if mask_kind == "padded":
        mask[1, :9] = 0
    reads = []
    with torch.no_grad():
        model(ids[:, :48], **({} if mask_kind == "none" else {"attention_mask": mask}), **cache_kwargs(cache))
        for i in range(48, 48 + steps):
            new = torch.ones(2, 1, dtype=torch.long)
            if mask_kind == "padded" and i == 55:
                new[0] = 0
            mask = torch.cat([mask, new], 1)
            with HostReads() as r:
                model(ids[:, i:i + 1], **({} if mask_kind == "none" else {"attention_mask": mask}),
                      **cache_kwargs(cache))
            reads.append(r)
    return reads[1:]


@pytest.mark.parametrize(("backend", "mask_kind"), [(b, m) for b in ("torch", "auto") for m in ("none", "ones", "padded")]
                         + [("triton", "padded")])  # the Triton kernel and its store kernel (interpreted here)
def test_steady_decode_step_reads_nothing(model, backend, mask_kind):
    for step in _steady_reads(model, backend, mask_kind):
        assert dict(step.sites) == {}, (backend, mask_kind, dict(step.sites))


def test_host_reads_are_seen():
    """The counter sees .item(), bool(), nonzero and tolist (a negative control for the assertions above)."""
    x = torch.arange(4)
    with HostReads() as r:
        x.sum().item()
        bool(x.all())
        x.nonzero()
        x.tolist()
    assert r.count == 4 and x.tolist() == [0, 1, 2, 3]  # counted while active, the method restored after
