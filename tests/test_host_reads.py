"""Host reads (device values read on the host: a stream sync on a GPU, and what CUDA graph capture refuses) of a
decode step, counted with `mla_quant.audit.HostReads` on a tiny two-layer DeepSeek-V3 with the int4_joint cache,
through the PyTorch layer and backend=auto (the C++ kernel here, the Triton kernel on a GPU; backend=triton's steady
steps are counted in tests/test_device_audit.py). A steady decode step reads nothing, with or without an attention
mask, padded batch or not."""

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
    """The host reads of each decode step after the first, over 24 steps: the window's tokens are staged into the
    pages every few steps; in the padded batch one step's new token is padding in one row."""
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


@pytest.mark.parametrize(("backend", "mask_kind"),
                         [(b, m) for b in ("torch", "auto") for m in ("none", "ones", "padded")])
def test_steady_decode_step_reads_nothing(model, backend, mask_kind):
    for step in _steady_reads(model, backend, mask_kind):
        assert dict(step.sites) == {}, (backend, mask_kind, dict(step.sites))


# What a prefill reads, once per forward whatever the number of layers, and why.
PREFILL = {
    # the mask hook reads the padding mask once: whether anything is padded (if not, the fused causal prefill), and
    # every layer's region bookkeeping, worked out on the host from this copy
    ("numpy", "absorbed.py:latent_mask"): 1,
    # the stored scales' finite check of every layer and path, one read after the last layer (an overflow is refused
    # naming its layer and path)
    ("_local_scalar_dense", "base.py:raise_unless_finite"): 1,
}


# A decode step of a format stored in token blocks (KIVI) is never steady: it takes the general append, whose
# bookkeeping reads the step's validity once per forward.
DECODE_TOKEN_BLOCKS = {("numpy", "contract.py:host_copy"): 1}


@pytest.mark.parametrize("fmt", ["int4_joint", "kivi_int2", "fp8_flat", "bf16"])
@pytest.mark.parametrize("layers", [2, 5])
def test_prefill_reads_once_per_forward_whatever_the_layers(fmt, layers):
    """A padded prefill and a second multi-token step (a chunk) read the listed places once each, with 2 layers
    as with 5; the decode step after reads nothing (token blocks: the listed read)."""
    model = build_model(compose("model=tiny_deepseek_v3", f"model.config.num_hidden_layers={layers}").model)
    extra = TINY if fmt != "kivi_int2" else TINY[1:]
    cache = quantized_cache(model, quant_cfg(fmt, *extra))
    ids = torch.randint(5, 500, (2, 81), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 81, dtype=torch.long)
    mask[1, :9] = 0
    # bf16 and fp8_flat store no scale per group (fp8_flat's per-sequence scale is amax / 448): nothing to check
    want = PREFILL if fmt in ("int4_joint", "kivi_int2") else {k: n for k, n in PREFILL.items() if "finite" not in k[1]}
    with torch.no_grad():
        for t0, t1 in ((0, 48), (48, 80), (80, 81)):
            with HostReads() as r:
                model(ids[:, t0:t1], attention_mask=mask[:, :t1], **cache_kwargs(cache))
            step = {} if fmt != "kivi_int2" else DECODE_TOKEN_BLOCKS
            assert dict(r.sites) == (want if t1 - t0 > 1 else step), (fmt, layers, t0, dict(r.sites))


def test_an_overflow_is_refused_after_the_forward_naming_its_layer(model):
    """The finite checks wait for the forward's last layer, then refuse naming the layer and path that overflowed."""
    cache = quantized_cache(model, quant_cfg("int4_joint", *TINY))
    ids = torch.randint(5, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    latent = cache.latent_layers[1]
    real = type(latent).append

    def huge(self, content, rope, valid=None):  # layer 1's latent beyond fp16: its zeros overflow
        return real(self, content * 1e6 if self is latent else content, rope, valid)

    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(type(latent), "append", huge)
        with pytest.raises(ValueError, match=r"cache layer 1, quant.content .*overflow.*scale_dtype=fp32"):
            model(ids, **cache_kwargs(cache))


def test_host_reads_are_seen():
    """The counter sees .item(), bool(), nonzero and tolist (a negative control for the assertions above)."""
    x = torch.arange(4)
    with HostReads() as r:
        x.sum().item()
        bool(x.all())
        x.nonzero()
        x.tolist()
    assert r.count == 4 and x.tolist() == [0, 1, 2, 3]  # counted while active, the method restored after
