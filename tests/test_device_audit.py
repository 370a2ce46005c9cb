"""The device audit: the model's work in every stage run with stray tensors caught (`mla_quant.audit.stray_device`:
a tensor made without naming its device lands on the meta device, so mixing it with the model's tensors, or copying
data out of it, fails here as a CPU tensor inside a CUDA forward fails on a GPU). Covered: prefill (the latent form
in blocks and the expanded form) and decode through every backend, padded batch, every kind of format; the cache's
reads and batch edits; calibration's capture and fit; the mixed allocation; lloyd's codebook fit; the sensitivity
study's injection; the lm-eval wrapper's loglikelihood and generation. Each audited run gives the same numbers as
the run outside the audit (the audit changes where a stray tensor lives, nothing else)."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from conftest import compose
from test_quant_cache import TINY, quant_cfg

from mla_quant import prepare, runner
from mla_quant.audit import HostReads, audited, stray_device
from mla_quant.calibration import sweep
from mla_quant.kernels.attention import AttentionBlocks
from mla_quant.models.absorbed import absorb, cache_kwargs, quantized_cache
from mla_quant.prepare import build_model

FORMATS = ["int4_joint", "int2_content_int4_rope", "kivi_int2", "fp8_flat", "fp8_ds_mla", "bf16"]
KERNEL_FORMATS = ["int4_joint", "int2_content_int4_rope", "bf16"]  # what the decode kernels read of them
# the Triton kernel (interpreted here, slowly) on one of them: both int paths, two widths


def test_a_stray_tensor_fails_under_the_audit():
    """The negative control: a tensor made without a device, mixed with the model's, fails; one made on the model's
    device does not."""
    x = torch.randn(3, 4)
    with stray_device():
        assert (x + torch.zeros(4, device=x.device)).device == x.device
        with pytest.raises(RuntimeError, match="device"):
            x + torch.zeros(4)


def _generate(model, fmt: str, backend: str, audit: bool, steps: int = 20, reads: list | None = None,
              length: int = 40):
    """Padded prefill of `length` tokens (7 of them padding in the second row), then `steps` greedy decode steps, a
    crop and a batch reorder midway; the cache's reads after. With `audit`, every model call and cache operation runs
    under `stray_device()` (the test's own inputs are made outside it). Returns every step's logits and the cache's
    read-back."""
    work = stray_device if audit else contextlib.nullcontext
    extra = TINY if fmt != "kivi_int2" else TINY[1:]  # KIVI's channel blocks take no group size
    cache = quantized_cache(model, quant_cfg(fmt, *extra, f"quant.backend={backend}"))
    ids = torch.randint(5, 500, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :7] = 0
    order = torch.tensor([1, 0])
    out = []
    with torch.no_grad():
        with work():
            logits = model(ids, attention_mask=mask, **cache_kwargs(cache)).logits[:, -1]
        for step in range(steps):
            out.append(logits)
            if step == 8:
                with work():
                    cache.crop(-1)
                mask = mask[:, :-1]
            if step == 14:
                with work():
                    cache.reorder_cache(order)
                out = [o.flip(0) for o in out]
                mask = mask.flip(0)
            tok = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            with work(), HostReads() as counted:
                logits = model(tok, attention_mask=mask, **cache_kwargs(cache)).logits[:, -1]
            if reads is not None:
                reads.append(dict(counted.sites))
        with work():
            reads = [x for layer in cache.layers for x in layer.read()]
    return out + reads


@pytest.fixture(scope="module")
def model():
    return build_model(compose(["model=tiny_deepseek_v3"]).model)


@pytest.mark.parametrize(("fmt", "backend"), [(f, "torch") for f in FORMATS]
                         + [(f, "cpu") for f in KERNEL_FORMATS] + [("int2_content_int4_rope", "triton")])
def test_prefill_decode_and_cache_edits_make_no_stray_tensor(model, fmt, backend):
    # the interpreter is slow (its store kernel runs once per token): a shorter prompt, 7 of its second row's 17
    # tokens quantized past the protected 10, and the cache edits are the other backends'
    steps, length = (20, 40) if backend != "triton" else (4, 24)
    reads = []
    want = _generate(model, fmt, backend, False, steps, length=length)
    got = _generate(model, fmt, backend, True, steps, reads, length=length)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    if fmt in KERNEL_FORMATS:  # and the decode steps read nothing on the host (tests/test_host_reads.py's property),
        # but for the one right after a crop or a reorder, whose append settles the regions again (the step's
        # validity copied to the host)
        settle = {("numpy", "contract.py:host_copy")}
        assert reads and all(set(r) <= (settle if i in (8, 14) else set()) for i, r in enumerate(reads)), str(reads)


def test_expanded_prefill_makes_no_stray_tensor():
    model = absorb(build_model(compose(["model=tiny_deepseek_v3"]).model, absorbed=False),
                   AttentionBlocks(query=16, key=64, expand_from=16))
    want, got = _generate(model, "int4_joint", "torch", False, 2), _generate(model, "int4_joint", "torch", True, 2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def _audit_stages(monkeypatch) -> collections.Counter:
    """Every model the stages build runs its forwards under the audit, and calibration's fit runs under it. Returns
    the count of audited calls by what was called."""
    calls = collections.Counter()

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return audited(run)

    def build(*args, build=prepare.build_model, **kwargs):
        model = build(*args, **kwargs)
        model.forward = counted("forward", model.forward)
        return model

    monkeypatch.setattr(prepare, "build_model", build)
    for name in ("fit_content", "fit_rope"):
        monkeypatch.setattr(sweep, name, counted(name, getattr(sweep, name)))
    return calls


def _records(tmp_path, monkeypatch, name, overrides) -> dict:
    run_dir = tmp_path / name
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: run_dir)
    return runner.main(compose(["logger=none", *overrides]))


def test_calibration_allocation_and_evaluation_make_no_stray_tensor(tmp_path, monkeypatch):
    """experiment=evaluate with quant=mixed over a QuantMLA-calibrated model: calibration's capture and fit, the
    mixed allocation, and lm-eval's loglikelihood and generation through the quantized cache, all audited."""
    calls = _audit_stages(monkeypatch)
    result = _records(tmp_path, monkeypatch, "eval", [
        "experiment=evaluate", "quant=mixed", "quant.budget=int4_joint", "transform=quantmla",
        "transform.fit.steps=2", f"transform.fit.cache_dir={tmp_path / 'calib'}", "quant.allocation.sequences=2",
        "quant.allocation.seeds=1", "calib.samples=4", "calib.seq_len=64",
        f"quant.allocation.cache_dir={tmp_path / 'alloc'}", "eval.control_no_rope.enabled=false",
        "eval.tasks=[toy_niah_single_1]", "eval.limit=2", "eval.data.niah_lengths=[256]",
        "eval.data.niah_per_length=2"])
    m = result.metrics
    assert m["calib/reused"] == 0 and m["alloc/reused"] == 0 and any(k.startswith("eval/") for k in m), sorted(m)
    assert calls["fit_content"] > 0 and calls["fit_rope"] > 0 and calls["forward"] > 10, calls


def test_sensitivity_and_codebooks_make_no_stray_tensor(tmp_path, monkeypatch):
    """The sensitivity study's injected forwards (fixed-NMSE noise and a quantizer's error) and lloyd's codebook fit,
    audited."""
    monkeypatch.chdir(tmp_path)  # the codebooks are stored under outputs/calibration of the working directory
    calls = _audit_stages(monkeypatch)
    _records(tmp_path, monkeypatch, "sens", [
        "experiment=sensitivity", "model=tiny_deepseek_v3", "task.seeds=1", "task.sweep_nmse=[0.02]",
        "task.probe.num_sequences=2", "task.probe.seq_len=32"])
    m = _records(tmp_path, monkeypatch, "sens_q", [
        "experiment=sensitivity", "model=tiny_deepseek_v3", "task.noise=quantizer", "quant=int4_joint",
        "quant.content.group_size=16", "quant.content.quantizer=lloyd", "task.seeds=1", "task.sweep_nmse=[]",
        "task.per_layer=false", "task.rope_pairs=false", "task.mechanism=false", "task.probe.num_sequences=2",
        "task.probe.seq_len=32", "calib.samples=4", "calib.seq_len=64"]).metrics
    assert m["sensitivity/output_nmse/content/logits"] > 0
    assert list((tmp_path / "outputs" / "calibration").glob("codebooks-*"))  # fitted here, under the audit
    assert calls["forward"] > 4, calls
