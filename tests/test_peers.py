"""Peer options (quant=hf_*): transformers' own QuantizedCache layers holding the latent. The absorbed model over
the peer layer gives exactly what it gives over transformers' QuantizedCache itself; a prompt scores the same alone
and in a padded batch; bytes are what the transformers layers hold; bad settings are refused by name."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from conftest import greedy_alone_and_in_batch
from transformers.cache_utils import QuantizedCache

from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.peers import PeerLatentCacheLayer
from mla_quant.models.absorbed import cache_kwargs, new_cache, quantized_cache
from mla_quant.quant.formats import cache_format
from mla_quant.quant.peers import PeerFormat
from mla_quant.toy.model import load_toy_model

pytestmark = pytest.mark.usefixtures("quanto_unpacks_in_python")

PEERS = ["hf_quanto_int2", "hf_hqq_int2", "hf_quanto_int4", "hf_hqq_int4"]
D_C, D_R = 96, 16  # the toy's latent dims


@pytest.fixture(scope="module")
def toy():
    return load_toy_model()


def peer(option: str, **settings):
    return OmegaConf.merge(load_quant_option(option), {"peer": settings})


def transformers_cache(model, fmt: PeerFormat) -> QuantizedCache:
    """The cache a user gets from transformers for the same settings."""
    return QuantizedCache(backend=fmt.library, config=model.config, nbits=fmt.bits, axis_key=fmt.axis,
                          axis_value=fmt.axis, q_group_size=fmt.group_size, residual_length=fmt.residual_length)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1024, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("option", PEERS)
def test_peer_layer_equals_transformers_quantized_cache(toy, option):
    """A 160-token prefill, then one-token steps past two requantizations of the history (residual 16): the logits
    of every step are those of transformers' QuantizedCache with the same settings, bit for bit."""
    cfg = peer(option, residual_length=16)
    fmt = cache_format(cfg, D_C, D_R)
    ours, theirs, exact = quantized_cache(toy, cfg), transformers_cache(toy, fmt), new_cache(toy)
    ids = prompt(160)
    steps = torch.randint(3, 1024, (40, 1), generator=torch.Generator().manual_seed(1))
    moved = 0.0
    with torch.no_grad():
        for x in [ids, *steps[:, None]]:
            a = toy(x, use_cache=True, **cache_kwargs(ours)).logits
            b = toy(x, use_cache=True, **cache_kwargs(theirs)).logits
            c = toy(x, use_cache=True, **cache_kwargs(exact)).logits
            assert torch.equal(a, b), f"{option}: differs from transformers' QuantizedCache by {(a - b).abs().max()}"
            moved = max(moved, float((a - c).abs().max()))
    assert moved > 1e-3, f"{option}: the peer cache never changed a logit"  # it does quantize


@pytest.mark.parametrize("option", PEERS)
def test_prompt_alone_equals_prompt_in_a_left_padded_batch(toy, option):
    """Greedy decoding of a 151-token prompt alone and left-padded beside a 190-token one (odd lengths: HQQ's
    packing needs the padding tokens of `row_class`), past several requantizations (residual 16)."""
    cfg = peer(option, residual_length=16)
    short, long = prompt(151, 2)[0], prompt(190, 3)[0]
    batch = torch.zeros(2, 190, dtype=torch.long)
    batch[0, 39:], batch[1] = short, long
    mask = torch.ones_like(batch)
    mask[0, :39] = 0
    runs = greedy_alone_and_in_batch(toy, short[None], batch, mask, lambda: quantized_cache(toy, cfg), 40)
    assert torch.equal(runs[0][0], runs[1][0]), f"{option}: greedy tokens depend on the batch"
    diff = float((runs[0][1] - runs[1][1]).abs().max())
    assert diff <= 1e-3, f"{option}: scores alone and in the batch differ by {diff:.3g}"


@pytest.mark.parametrize("option", ["hf_quanto_int2", "hf_hqq_int2"])
def test_bytes_are_the_tensors_transformers_holds(option):
    """After a 301-token prefill and 150 steps (residual 128: one requantization at 128 gathered tokens), 429 tokens
    are quantized and 22 wait unquantized: codes 2 bits x 112, a scale and a zero (shift) per 16 channels in the
    activation dtype (float32 here), the residual in float32. The packing's alignment is held, not used."""
    fmt = cache_format(load_quant_option(option), D_C, D_R)
    layer = PeerLatentCacheLayer(fmt)
    g = torch.Generator().manual_seed(0)
    layer.append(torch.randn(1, 301, D_C, generator=g), torch.randn(1, 301, D_R, generator=g))
    for _ in range(150):
        layer.append(torch.randn(1, 1, D_C, generator=g), torch.randn(1, 1, D_R, generator=g))
    per_quantized = 2 * (D_C + D_R) // 8 + 2 * 4 * (D_C + D_R) // 16  # 28 + 56
    assert layer.nbytes() == 429 * per_quantized + 22 * (D_C + D_R) * 4
    assert 0 <= layer.held_bytes() - layer.nbytes() < 4 * 16 * 2  # the packing's alignment: a few groups per path
    assert layer.real_tokens() == 451
    assert fmt.bytes_per_token(2) == 28 + 28  # nominal: fp16 scales and zeros on a BF16 checkpoint


def test_padding_slots_are_not_stored():
    """A padded row stores its real tokens only: the same bytes as the row alone."""
    fmt = cache_format(load_quant_option("hf_hqq_int2"), D_C, D_R)
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(2, 200, D_C, generator=g), torch.randn(2, 200, D_R, generator=g)
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[0, :37] = False
    batch, alone = PeerLatentCacheLayer(fmt), PeerLatentCacheLayer(fmt)
    batch.append(c, r, valid)
    alone.append(c[:1, 37:], r[:1, 37:])
    other = PeerLatentCacheLayer(fmt)
    other.append(c[1:], r[1:])
    assert batch.nbytes() == alone.nbytes() + other.nbytes()
    got_c, _ = batch.read()
    want_c, _ = alone.read()
    assert torch.equal(got_c[0, 37:], want_c[0]) and not bool(got_c[0, :37].any())


@pytest.mark.parametrize("settings, match", [
    ({"library": "bitsandbytes"}, r"quant.peer.library='bitsandbytes' is unknown; allowed: \['hqq', 'quanto'\]"),
    ({"library": "quanto", "bits": 3}, r"quant.peer.bits=3: transformers' quanto cache takes bits \[2, 4\]"),
    ({"group_size": 24}, r"group_size=24 does not divide d_r=16 .*allowed: one of \[1, 2, 4, 8, 16\]"),
    ({"group_size": 0}, r"quant.peer.group_size=0; allowed: a positive integer"),
    ({"residual_length": 0}, r"quant.peer.residual_length=0; allowed: an integer >= 1"),
    ({"axis": 1}, r"quant.peer: unknown key\(s\) \['axis'\]"),
])
def test_bad_peer_settings_are_refused_by_name(settings, match):
    with pytest.raises(ValueError, match=match):
        cache_format(peer("hf_hqq_int2", **settings), D_C, D_R)


def test_project_settings_on_a_peer_are_refused():
    cfg = OmegaConf.merge(load_quant_option("hf_quanto_int2"), {"mode": "simulated"})
    with pytest.raises(ValueError, match=r"\['mode'\] do not apply to a peer option"):
        cache_format(cfg, D_C, D_R)


def test_missing_library_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("optimum") else
                        real(name, *a))
    with pytest.raises(ValueError, match=r"needs the optimum-quanto package: pip install -e \"\.\[peers\]\""):
        cache_format(load_quant_option("hf_quanto_int4"), D_C, D_R)


def test_fitted_transform_on_a_peer_names_its_fit_format(cfg_of):
    from mla_quant.prepare import model_dims, validate

    cfg = cfg_of(["experiment=evaluate", "quant=hf_hqq_int2", "transform=quantmla", "calib=toy"])
    with pytest.raises(ValueError, match=r"transform=quantmla with quant=hf_hqq_int2: .*transform.fit.format="
                                         r"int2_joint"):
        validate(cfg, model_dims(cfg.model))
    ok = cfg_of(["experiment=evaluate", "quant=hf_hqq_int2", "transform=quantmla", "calib=toy",
                 "transform.fit.format=int2_joint"])
    spec = validate(ok, model_dims(ok.model))
    assert spec.peer and isinstance(spec.uniform, PeerFormat)


def test_crop_is_refused_with_the_reason():
    layer = PeerLatentCacheLayer(cache_format(load_quant_option("hf_quanto_int2"), D_C, D_R))
    layer.append(torch.randn(1, 4, D_C), torch.randn(1, 4, D_R))
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        layer.crop(-1)


def test_peer_option_scores_through_lm_eval(tmp_path, cfg_of, monkeypatch):
    """experiment=evaluate with a peer: lm-eval's generate over the peer cache, the record naming what it held; the
    settings validated once (the stage's own check), not again by the preparation step."""
    import mla_quant.prepare
    from mla_quant.stages.evaluate import run

    validate, calls = mla_quant.prepare.validate, []
    monkeypatch.setattr(mla_quant.prepare, "validate", lambda *a, **k: calls.append(1) or validate(*a, **k))
    cfg = cfg_of(["experiment=evaluate", "logger=none", "quant=hf_hqq_int2", "eval.tasks=[toy_niah_single_1]",
                  "eval.data.niah_per_length=2", "eval.data.niah_lengths=[256]", "eval.control_no_rope.enabled=false"])
    metrics = run(cfg, tmp_path).metrics
    assert len(calls) == 1
    assert 0.0 <= metrics["eval/toy_niah_single_1/exact_match"] <= 1.0
    assert metrics["cache/content"].startswith("transformers QuantizedCache (hqq) int2 g=16")
    assert metrics["cache/bytes_per_token_per_layer"] == 56.0


def test_stages_that_read_the_project_formats_refuse_a_peer(cfg_of, tmp_path):
    """The byte table, quantizer-shaped noise, export, serving capacity and the kernel benchmark read the project's
    formats (codecs, byte formula, kernel): a peer is refused by name there, before any work."""
    from mla_quant.cache.bytes import byte_table
    from mla_quant.stages import bench_kernel, export, serving
    from mla_quant.stages.sensitivity import noise_quantizers

    peer_named = r"quant=hf_hqq_int2 is transformers' own QuantizedCache \(a peer option\): "
    with pytest.raises(ValueError, match=peer_named + "the byte table"):
        byte_table(["int4_joint", "hf_hqq_int2"], [4096])
    with pytest.raises(ValueError, match=peer_named + r"task.noise=quantizer"):
        noise_quantizers(cfg_of(["experiment=sensitivity", "task.noise=quantizer", "quant=hf_hqq_int2"]),
                         {"content": D_C, "rope": D_R})
    with pytest.raises(ValueError, match=peer_named + "experiment=export"):
        export.run(cfg_of(["experiment=export", "quant=hf_hqq_int2"]), tmp_path)
    with pytest.raises(ValueError, match=peer_named + "experiment=serving"):
        serving.formats(cfg_of(["experiment=serving", "task.formats=[bf16,hf_hqq_int2]"]),
                        SimpleNamespace(d_c=512, d_r=64))
    with pytest.raises(ValueError, match=peer_named + "experiment=bench_kernel"):
        bench_kernel.filled_layer("hf_hqq_int2", None, 64, 1, "cpu", torch.float32, torch.Generator())
    assert not any(tmp_path.iterdir())  # export refused before writing anything
