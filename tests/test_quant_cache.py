"""The quantized latent cache: config options and errors, exactness of the bf16 format and of the protected region,
simulated vs serving semantics through a tiny absorbed model, cache management, and the byte targets."""

import copy
from pathlib import Path

import hydra
import pytest
import torch
from conftest import CPU_DECODE
from omegaconf import OmegaConf

from mla_quant.cache import LatentCacheLayer, cache_layer_factory
from mla_quant.cache.bytes import HeldBytes, byte_table, load_quant_option, measure_bytes
from mla_quant.kernels.attention import latent_attention
from mla_quant.models.absorbed import cache_kwargs, latent_dims, new_cache, quantized_cache
from mla_quant.prepare import build_model
from mla_quant.quant.codecs.fp8 import fp8_fake_quantize
from mla_quant.quant.formats import cache_bytes_per_token, cache_format, fake_quantizer
from mla_quant.quant.quantizers import fake_quantize

CONF = Path(__file__).resolve().parents[1] / "conf"
# The project's own uniform formats; the peers (transformers' QuantizedCache, conf/quant/hf_*.yaml) are
# tests/test_peers.py's, quant=mixed (allocated per layer) tests/test_mixed.py's.
OPTIONS = sorted(p.stem for p in (CONF / "quant").glob("*.yaml")
                 if "\npeer:" not in p.read_text() and "\nbudget:" not in p.read_text())
PEERS = sorted(p.stem for p in (CONF / "quant").glob("*.yaml") if "\npeer:" in p.read_text())
# The tiny model has d_c=32, d_r=8: groups of 128 do not divide 32, and a short prompt needs a short window.
TINY = ["quant.content.group_size=16", "quant.protected.n_sink=2", "quant.protected.recent=8"]


def compose(*overrides):
    """The run config; the quant options' content groups resolve for d_c = 512 unless a model is chosen."""
    overrides = list(overrides[0]) if len(overrides) == 1 and isinstance(overrides[0], list) else list(overrides)
    if not any(o.startswith("model=") for o in overrides):
        overrides.insert(0, "model=tiny_deepseek_v2_lite_dims")
    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra.compose("config", overrides=overrides)


def quant_cfg(option, *overrides):
    """What `quant=<option> quant.a.b=v ...` composes to, without Hydra's ~0.4 s per compose (checked equal to
    Hydra's own composition in test_every_option_composes_and_builds and test_command_line_per_path_combination)."""
    dotlist = [o.removeprefix("quant.") for o in overrides]
    return OmegaConf.merge(load_quant_option(option), OmegaConf.from_dotlist(dotlist))


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def model():
    return build_model(compose("model=tiny_deepseek_v3").model)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def bf16_logits(model, ids):
    with torch.no_grad():
        return model(ids, **cache_kwargs(new_cache(model))).logits


def prefill_logits(model, ids, quant_cfg):
    with torch.no_grad():
        return model(ids, **cache_kwargs(quantized_cache(model, quant_cfg))).logits


# ---------------------------------------------------------------------------------------------- config
def _shape(cfg) -> dict:
    return {k: _shape(v) if isinstance(v, dict) else None for k, v in cfg.items()}


def test_required_options_exist():
    required = {"bf16", "fp8_flat", "fp8_ds_mla", "int4_content", "int4_joint", "int2_content_int4_rope", "int8_joint"}
    assert required <= set(OPTIONS), f"missing quant options: {required - set(OPTIONS)}"
    assert PEERS == ["hf_hqq_int2", "hf_hqq_int4", "hf_quanto_int2", "hf_quanto_int4"]


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_composes_and_builds(option):
    quant = OmegaConf.create(OmegaConf.to_container(compose(f"quant={option}").quant, resolve=True))
    assert quant == load_quant_option(option)
    bf16 = OmegaConf.to_container(load_quant_option("bf16"))
    assert _shape(OmegaConf.to_container(quant)) == _shape(bf16), f"{option} does not have the shape of bf16.yaml"
    assert quant.name == option
    factory = cache_layer_factory(quant, d_c=512, d_r=64)
    layer = factory()
    assert isinstance(layer, LatentCacheLayer) and layer.fmt.name == option
    assert layer.quantized == (option != "bf16")
    # on the CPU (auto) decode steps take the C++ kernel where it reads the format, PyTorch otherwise
    assert layer.fmt.step_backends("cpu")["decode"] == ("torch" if layer.fmt.cpu_kernel_unsupported() else CPU_DECODE)


def test_command_line_per_path_combination():
    overrides = ("quant.content.bits=3", "quant.rope.bits=8", "quant.content.group_size=64")
    quant = OmegaConf.create(OmegaConf.to_container(compose("quant=int4_joint", *overrides).quant, resolve=True))
    assert quant == quant_cfg("int4_joint", *overrides)
    fmt = cache_format(quant, 512, 64)
    assert (fmt.content.bits, fmt.rope.bits, fmt.content.group_size) == (3, 8, 64)
    assert fmt.content.bytes_per_token(512) == 192 + 8 * 4 and fmt.rope.bytes_per_token(64) == 64 + 4
    layer = cache_layer_factory(quant, 512, 64)()
    c, r = torch.randn(1, 300, 512), torch.randn(1, 300, 64)
    layer.append(c, r)
    assert layer.n_quantized == 300 - 4 - 128
    assert layer.nbytes() == 132 * 576 * 4 + 168 * (224 + 68)  # float32 protected tokens here
    rc, rr = layer.read()
    mid = slice(4, 172)  # int3 over groups of 64 Gaussians: RMS error ~ (range / 7) / sqrt(12) ~ 0.2
    err_c, err_r = rel_err(rc[:, mid], c[:, mid]), rel_err(rr[:, mid], r[:, mid])
    assert 0.1 < err_c < 0.3 and 1e-3 < err_r < 0.01, f"content rel err {err_c:.3g}, rope (int8) {err_r:.3g}"
    # from the bf16 option, a low bit width alone selects the integer format (the example command)
    fmt = cache_format(compose("quant.content.bits=3", "quant.rope.bits=8", "quant.content.group_size=64").quant, 512, 64)
    assert (fmt.content.format, fmt.content.bits, fmt.content.group_size) == ("int", 3, 64)
    assert (fmt.rope.format, fmt.rope.bits) == ("int", 8)
    fmt = cache_format(compose("quant.content.bits=3").quant, 512, 64)
    assert fmt.content.bits == 3 and not fmt.rope.quantized


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["quant=bf16", "quant.content.bits=5"], r"quant.content.bits=5 .*\[2, 3, 4, 8\]"),
        (["quant=int4_joint", "quant.content.bits=5"], r"quant.content.bits=5 .*\[2, 3, 4, 8\]"),
        (["quant=int4_joint", "quant.content.group_size=100"], r"group_size=100 does not divide .* 512"),
        (["quant=int4_joint", "quant.rope.group_size=48"], r"quant.rope.group_size=48 does not divide .* 64"),
        (["quant=int4_joint", "quant.rope.scale_dtype=fp8"], r"scale_dtype='fp8'.*pow2"),
        (["quant=fp8_ds_mla", "quant.content.bits=4"], r"bits=4 is not a width of format=fp8"),
        (["quant=int4_joint", "quant.content.format=nf4"], r"format='nf4'.*bf16"),
        (["quant=int4_joint", "quant.mode=fast"], r"quant.mode='fast'.*serving"),
        (["quant=int4_joint", "quant.content.bitz=4"], r"unknown key\(s\) \['bitz'\]"),
        (["quant=int4_joint", "quant.shared_scale=true"], r"shared_scale=true needs both paths"),
        (["quant=int4_joint", "quant.protected.recent=-1"], r"recent=-1"),
    ],
)
def test_bad_config_fails_early_naming_the_value(overrides, match):
    cfg = quant_cfg(overrides[0].removeprefix("quant="), *overrides[1:])
    with pytest.raises(ValueError, match=match):
        cache_layer_factory(cfg, d_c=512, d_r=64)


def test_dimension_checked_against_the_model(model):
    assert latent_dims(model)["d_c"] == 32
    with pytest.raises(ValueError, match=r"group_size=128 does not divide the path dimension 32"):
        quantized_cache(model, quant_cfg("int4_joint"))


# ---------------------------------------------------------------------------------------------- exactness
def test_bf16_format_equals_plain_layer(model, ids, bf16_logits):
    fmt = cache_format(quant_cfg("bf16", "quant.protected.recent=8"), 32, 8)
    layer = lambda: LatentCacheLayer(fmt)  # noqa: E731 - bypasses the factory's bf16 shortcut on purpose
    with torch.no_grad():
        logits = model(ids, **cache_kwargs(new_cache(model, layer))).logits
    assert torch.equal(logits, bf16_logits), f"max diff {float((logits - bf16_logits).abs().max())}"
    runs = []
    for factory in (None, layer):
        cache = new_cache(model, factory)
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True,
                             attention_mask=torch.ones_like(ids), pad_token_id=0, **cache_kwargs(cache))
        runs.append((out.sequences, torch.stack(out.logits), cache))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1]), f"max diff {float((runs[0][1] - runs[1][1]).abs().max())}"
    assert runs[1][2].layers[0].n_quantized == 45  # unquantized: every token in the paged store, nothing protected


class FakeQuantMiddle(LatentCacheLayer):
    """Independent reference for simulated int4_joint on the tiny model: fake-quantize the non-protected tokens."""

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, **absorbed):
        self.append(content, rope, valid)
        c, r = self.read()
        c, r = c.clone(), r.clone()
        c[:, 2:-8] = fake_quantize(c[:, 2:-8], 4, 16)
        r[:, 2:-8] = fake_quantize(r[:, 2:-8], 4, None)
        return latent_attention(q_latent, q_rope, c, r, scale, mask, **absorbed)


def test_simulated_prefill_equals_fake_quant_reference(model, ids, bf16_logits):
    logits = prefill_logits(model, ids, quant_cfg("int4_joint", *TINY))
    with torch.no_grad():
        ref = model(ids, **cache_kwargs(new_cache(model, FakeQuantMiddle))).logits
    assert torch.equal(logits, ref), f"max diff {float((logits - ref).abs().max())}"
    assert rel_err(logits, bf16_logits) > 1e-3


def test_low_bit_generation_is_finite_and_plausible(model, ids, bf16_logits):
    errs = {}
    for option in ("int8_joint", "int4_joint", "int2_content_int4_rope", "fp8_ds_mla"):
        logits = prefill_logits(model, ids, quant_cfg(option, *TINY))
        assert bool(torch.isfinite(logits).all()), option
        errs[option] = rel_err(logits, bf16_logits)
    assert errs["int8_joint"] < errs["int4_joint"] < errs["int2_content_int4_rope"], f"logit rel errors {errs}"
    assert 1e-4 < errs["int8_joint"] < 0.05 and 1e-3 < errs["int4_joint"] < 0.5, f"logit rel errors {errs}"
    assert errs["int2_content_int4_rope"] < 1.0, f"logit rel errors {errs}"
    cache = quantized_cache(model, quant_cfg("int2_content_int4_rope", *TINY))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True,
                         attention_mask=torch.ones_like(ids), pad_token_id=0, **cache_kwargs(cache))
    assert out.sequences.shape == (2, 45) and bool(torch.isfinite(torch.stack(out.logits)).all())
    assert cache.get_seq_length() == 44 and cache.layers[-1].n_quantized == 44 - 2 - 8


def test_serving_prefill_exact_then_decode_sees_stored(model, ids, bf16_logits):
    serving = quant_cfg("int4_joint", "quant.mode=serving", *TINY)
    simulated = quant_cfg("int4_joint", "quant.mode=simulated", *TINY)
    caches = {}
    with torch.no_grad():
        for name, q in (("bf16", None), ("serving", serving), ("simulated", simulated)):
            cache = new_cache(model) if q is None else quantized_cache(model, q)
            prefill = model(ids, **cache_kwargs(cache)).logits
            step = model(ids[:, :1] * 0 + 7, **cache_kwargs(cache)).logits  # one decode step on token 7
            caches[name] = (prefill, step)
    assert torch.equal(caches["serving"][0], bf16_logits), "serving prefill must not see its own quantization"
    assert rel_err(caches["simulated"][0], bf16_logits) > 1e-3
    step_err = rel_err(caches["serving"][1], caches["bf16"][1])
    assert 1e-4 < step_err < 0.5, f"serving decode step vs bf16: rel {step_err:.3g}"


# ---------------------------------------------------------------------------------------------- layer behaviour
def small_layer(mode="simulated", option="int2_content_int4_rope", **extra):
    quant = quant_cfg(option, f"quant.mode={mode}", "quant.content.group_size=16", "quant.protected.n_sink=4",
                      "quant.protected.recent=16", *[f"quant.{k}={v}" for k, v in extra.items()])
    return cache_layer_factory(quant, d_c=64, d_r=16)()


def test_protected_region_exact_and_tokens_quantized_once():
    gen = torch.Generator().manual_seed(3)
    c_all, r_all = torch.randn(2, 70, 64, generator=gen), torch.randn(2, 70, 16, generator=gen)
    layer, one_shot = small_layer(), small_layer()
    one_shot.append(c_all, r_all)
    s, snapshot = 0, None
    for t in (3, 30, 1, 1, 5, 1, 29):
        layer.append(c_all[:, s : s + t], r_all[:, s : s + t])
        s += t
        c, r = layer.read()
        q = max(0, s - 4 - 16)
        assert layer.length == s and layer.n_quantized == q, f"S={s}: n_quantized {layer.n_quantized}, expected {q}"
        sink, recent = slice(0, min(s, 4)), slice(max(s - 16, min(s, 4)), s)
        for got, x in ((c, c_all), (r, r_all)):
            assert torch.equal(got[:, sink], x[:, sink]) and torch.equal(got[:, recent], x[:, recent]), f"S={s}"
        if q:
            mid = slice(4, 4 + q)
            assert not torch.equal(c[:, mid], c_all[:, mid]), "int2 middle tokens read back unquantized"
            assert torch.equal(c[:, mid], fake_quantize(c_all[:, mid], 2, 16))
            assert torch.equal(r[:, mid], fake_quantize(r_all[:, mid], 4, None))
            codes = layer.stored_parts("content")["codes"]
            if snapshot is not None:  # tokens already quantized never change
                assert torch.equal(codes[:, : snapshot.shape[1]], snapshot)
            snapshot = codes.clone()
    # chunking does not matter: the same tokens give the same stored tensors
    for path in ("content", "rope"):
        for k, v in one_shot.stored_parts(path).items():
            assert torch.equal(layer.stored_parts(path)[k], v), f"{path}.{k} depends on the append chunking"
    parts = layer.stored_parts("content")
    assert parts["codes"].dtype == torch.int32 and parts["codes"].shape == (2, 50, 4)  # 64 int2 codes = 4 words
    assert parts["scales"].dtype == torch.float16 and parts["scales"].shape == (2, 50, 4)
    assert parts["zeros"].dtype == torch.float16 and layer.stored_parts("rope")["codes"].shape == (2, 50, 2)


def test_serving_layer_sees_fresh_then_stored():
    gen = torch.Generator().manual_seed(4)
    c, r = torch.randn(1, 40, 64, generator=gen), torch.randn(1, 40, 16, generator=gen)
    for mode in ("serving", "simulated"):
        layer = small_layer(mode)
        got_c, got_r = layer.update_and_read(c, r)
        assert layer.n_quantized == 20
        assert torch.equal(got_c, c) == (mode == "serving") and torch.equal(got_r, r) == (mode == "serving"), mode
        c1, r1 = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 16, generator=gen)
        got_c, got_r = layer.update_and_read(c1, r1)
        assert torch.equal(got_c[:, -1:], c1) and torch.equal(got_c[:, :4], c[:, :4])
        assert torch.equal(got_c[:, 4:25], fake_quantize(c[:, 4:25], 2, 16)), f"{mode}: older tokens not stored values"


def test_fp8_flat_shared_first_batch_scale():
    layer = cache_layer_factory(quant_cfg("fp8_flat"), 512, 64)()
    gen = torch.Generator().manual_seed(5)
    c, r = torch.randn(1, 10, 512, generator=gen), 5 * torch.randn(1, 10, 64, generator=gen)
    layer.append(c, r)
    scale = layer.tensor_scales["content"]
    assert scale is layer.tensor_scales["rope"] and scale.shape == (1,)  # one scale per sequence
    assert float(scale) == pytest.approx(float(torch.cat([c.flatten(), r.flatten()]).abs().max()) / 448)
    layer.append(100 * c[:, :1], r[:, :1])  # later, larger tokens: same frozen scale, saturating at 448 * scale
    assert layer.tensor_scales["content"] is scale
    got_c, _ = layer.read()
    assert float(got_c[:, -1].abs().max()) == pytest.approx(448 * float(scale))
    assert layer.nbytes() == 11 * 576 + 4


def test_crop_and_batch_operations():
    gen = torch.Generator().manual_seed(6)
    c, r = torch.randn(3, 40, 64, generator=gen), torch.randn(3, 40, 16, generator=gen)
    layer = small_layer()
    layer.append(c, r)
    full_c, full_r = layer.read()
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer.read()[0], full_c[[2, 0, 1]]) and torch.equal(layer.read()[1], full_r[[2, 0, 1]])
    layer.batch_select_indices(torch.tensor([1, 2]))  # back to the original order of sequences 0, 1
    full_c, full_r = full_c[:2], full_r[:2]
    assert torch.equal(layer.read()[0], full_c)
    layer.crop(-22)  # all 16 recent tokens and 6 quantized ones
    assert (layer.length, layer.n_quantized) == (18, 14)
    assert torch.equal(layer.read()[0], full_c[:, :18]) and torch.equal(layer.read()[1], full_r[:, :18])
    extra = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 16, generator=gen)
    layer.append(*extra)  # refills the window; nothing new is quantized yet
    assert (layer.length, layer.n_quantized) == (21, 14)
    assert torch.equal(layer.read()[0][:, :18], full_c[:, :18]) and torch.equal(layer.read()[0][:, 18:], extra[0])
    layer.crop(-19)  # into the sinks
    assert (layer.length, layer.n_quantized) == (2, 0) and torch.equal(layer.read()[0], full_c[:, :2])
    layer.batch_repeat_interleave(2)  # (empty stores follow the batch size too)
    layer.append(torch.randn(4, 30, 64, generator=gen), torch.randn(4, 30, 16, generator=gen))
    assert layer.read()[0].shape == (4, 32, 64) and layer.n_quantized == 12
    assert torch.equal(layer.read()[0][:, :2], full_c[:, :2].repeat_interleave(2, dim=0))
    with pytest.raises(ValueError, match="got 3"):
        layer.crop(3)


# ---------------------------------------------------------------------------------------------- bytes
def used_bytes(quant, contexts, chunk, batch=1, block_size=None):
    """{context: (used, held)} of one layer filled in chunks, at d_c 512, d_r 64."""
    if block_size is not None:
        quant = OmegaConf.merge(quant, {"block_size": block_size})
    return measure_bytes(cache_format(quant, 512, 64), contexts, batch=batch, chunk=chunk)


def test_industry_layouts_exact_bytes():
    for option, per_token, constant in (("fp8_flat", 576, 4), ("fp8_ds_mla", 656, 0), ("bf16", 1152, 0)):
        quant = quant_cfg(option)
        measured = used_bytes(quant, (1, 300, 1000), chunk=256)
        for s, (nbytes, held) in measured.items():
            assert nbytes == per_token * s + constant, f"{option} at {s} tokens: {nbytes} B"
            assert nbytes <= held <= nbytes + 64 * per_token, f"{option} at {s}: held {held} B, used {nbytes} B"


@pytest.mark.parametrize("option", ["bf16", "int4_joint", "int2_content_int4_rope", "fp8_flat"])
@pytest.mark.parametrize("block", [16, 64])
def test_paged_storage_holds_at_most_one_block_more_than_it_uses(option, block):
    """Held bytes (whole blocks + protected buffers) <= used + one partly filled block per sequence, at every
    length; blocks come on demand (no doubling)."""
    fmt = cache_format(OmegaConf.merge(quant_cfg(option), {"block_size": block}), 512, 64)
    per_block = block * (fmt.content.bytes_per_token(512) + fmt.rope.bytes_per_token(64))
    measured = measure_bytes(fmt, (1, 7, 131, 132, 133, 200, 1000, 1001), batch=3, chunk=97)
    for s, (nbytes, held) in measured.items():
        assert nbytes <= held <= nbytes + 3 * per_block, f"{option}, block {block}, {s} tokens: held {held}, used {nbytes}"


@pytest.mark.parametrize("option", ["int8_joint", "int4_content", "int4_joint", "int2_content_int4_rope"])
def test_measured_bytes_equal_formula_and_scale_linearly(option):
    quant = quant_cfg(option)
    fmt = cache_format(quant, 512, 64)
    per_quantized = fmt.content.bytes_per_token(512) + fmt.rope.bytes_per_token(64)
    measured = {s: used for s, (used, _) in used_bytes(quant, (100, 1000, 4096), chunk=512).items()}
    for s, nbytes in measured.items():
        assert nbytes == cache_bytes_per_token(fmt, 512, 64, s) * s, f"{option} at {s}: {nbytes} B measured"
    assert measured[4096] - measured[1000] == per_quantized * 3096, "bytes do not grow by the per-token format size"
    assert measured[100] == 100 * 1152  # all protected


def test_byte_targets_at_128k():
    expected = {"int4_joint": (308, 27.9), "int2_content_int4_rope": (196, 17.5), "int4_content": (400, 36),
                "int8_joint": (596, 52)}
    for option, (per_quantized, pct_max) in expected.items():
        fmt = cache_format(quant_cfg(option), 512, 64)
        assert fmt.content.bytes_per_token(512) + fmt.rope.bytes_per_token(64) == per_quantized, option
        pct = 100 * cache_bytes_per_token(fmt, 512, 64, 131072) / 1152
        assert pct <= pct_max, f"{option}: {pct:.2f}% of BF16 at 128K (target <= {pct_max}%)"
    rows = byte_table(("fp8_ds_mla", "int4_joint"), contexts=(300, 2000), chunk=512)
    assert len(rows) == 4 and all(row["used_B_per_token"] == row["formula_B_per_token"] for row in rows), rows


def test_fake_quantizer_matches_the_cache_read():
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(7))
    cfg = quant_cfg("int2_content_int4_rope", "quant.content.group_size=16", "quant.protected.recent=4")
    fq = fake_quantizer(cfg.content, 64, path="content")
    assert torch.equal(fq(x), fake_quantize(x, 2, 16))
    layer = cache_layer_factory(cfg, 64, 64)()
    layer.append(x, x)
    assert torch.equal(layer.read()[0][:, 4:26], fq(x[:, 4:26]))
    assert torch.equal(fake_quantizer(quant_cfg("fp8_ds_mla").rope, 64)(x), x)  # bf16 path: identity
    fp8 = fake_quantizer(quant_cfg("fp8_ds_mla", "quant.content.group_size=32").content, 64)
    assert torch.equal(fp8(x), fp8_fake_quantize(x, 32))
    with pytest.raises(ValueError, match=r"quant.rope.group_size=128 does not divide the path dimension 64"):
        fake_quantizer(quant_cfg("int4_joint", "quant.rope.group_size=128").rope, 64, path="rope")


def test_protected_region_covering_the_context_is_refused():
    from conftest import compose

    from mla_quant.quant.formats import cache_format

    q = compose(["quant=int4_joint"]).quant
    cache_format(q, 512, 64, context=1024)  # fine: 132 protected of 1024
    with pytest.raises(ValueError, match=r"n_sink \+ recent = 4 \+ 128 = 132 covers the whole context of 100"):
        cache_format(q, 512, 64, context=100)
    cache_format(compose(["quant=bf16"]).quant, 512, 64, context=100)  # nothing quantized: nothing to protect


def test_cache_bytes_experiment_measures_every_option(tmp_path):
    from conftest import compose

    from mla_quant.stages import cache_bytes

    cfg = compose(["experiment=cache_bytes", "task.contexts=[512,1024]", "task.chunk=256"])
    result = cache_bytes.run(cfg, tmp_path)
    m = result.metrics
    assert result.ok
    assert m["bytes/fp8_ds_mla/ctx1024/used_bytes_per_token_per_layer"] == 656
    assert m["bytes/bf16/ctx512/used_bytes_per_token_per_layer"] == 1152
    assert all(1.0 <= m[f"bytes/{o}/ctx1024/held_over_used"] <= 1.05 for o in ("bf16", "int4_joint", "fp8_flat"))
    # The protected region (4 + 128 BF16 tokens) weighs less as the context grows.
    assert m["bytes/int4_joint/ctx1024/pct_of_bf16"] < m["bytes/int4_joint/ctx512/pct_of_bf16"]
    assert (tmp_path / "cache_bytes.md").exists()


@pytest.mark.parametrize("quantizer", ["clip", "hqq"])
def test_cache_stores_what_the_chosen_quantizer_reads_back(quantizer):
    """quant.<path>.quantizer reaches the cache: it reads back exactly fake_quantizer's values for that quantizer,
    in the same bytes as RTN, closer to the latent than RTN at 2 bits; other formats refuse it by name."""
    from omegaconf import OmegaConf

    from mla_quant.cache import cache_layer_factory
    from mla_quant.cache.bytes import load_quant_option
    from mla_quant.quant.formats import cache_format, fake_quantizer

    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(2, 40, 96, generator=g) * torch.exp(torch.randn(96, generator=g)), torch.randn(2, 40, 16,
                                                                                                      generator=g)
    out = {}
    for qz in ("rtn", quantizer):
        cfg = OmegaConf.merge(load_quant_option("int2_joint", groups={"wide": 32, "narrow": 32}),
                              {"protected": {"n_sink": 0, "recent": 0}, "content": {"quantizer": qz},
                               "rope": {"quantizer": qz}})
        layer = cache_layer_factory(cfg, 96, 16)()
        layer.append(c, r)
        got_c, got_r = layer.read()
        fmt = cache_format(cfg, 96, 16)
        torch.testing.assert_close(got_c, fake_quantizer(fmt.content, 96)(c), rtol=0, atol=0)
        torch.testing.assert_close(got_r, fake_quantizer(fmt.rope, 16)(r), rtol=0, atol=0)
        out[qz] = (float((got_c - c).pow(2).sum() / c.pow(2).sum()), layer.nbytes())
    assert out[quantizer][1] == out["rtn"][1] and out[quantizer][0] < out["rtn"][0], out
    bad = OmegaConf.merge(load_quant_option("fp8_ds_mla"), {"content": {"quantizer": quantizer}})
    with pytest.raises(ValueError, match=f"quant.content.quantizer='{quantizer}' .* format=fp8 takes quantizer=rtn"):
        cache_format(bad, 512, 64)


def test_lloyd_cache_reads_its_codebook_and_counts_its_bytes():
    """A lloyd path stores RTN's layout and reads levels[q] s + z: exactly fake_quantizer's values with the same
    levels, closer to the latent than RTN; its bytes are RTN's plus the codebook (float32 levels per path, once per
    layer), measured from the layer and equal to the formula. A lloyd format without fitted levels cannot build a
    cache layer (it would have no fixed codebook to store codes against)."""
    import dataclasses

    from mla_quant.calibration.codebooks import fitted_on

    from mla_quant.cache import layer_factory

    g = torch.Generator().manual_seed(0)
    c = torch.distributions.Laplace(0.0, 1.0).sample((2, 300, 96)) * torch.exp(torch.randn(96, generator=g))
    r = torch.randn(2, 300, 16, generator=g) * 3
    out = {}
    for qz in ("rtn", "lloyd"):
        cfg = quant_cfg("int2_joint", "quant.content.group_size=32", f"quant.content.quantizer={qz}",
                        f"quant.rope.quantizer={qz}")
        fmt = fitted_on(cache_format(cfg, 96, 16, context=300), c, r)
        layer = layer_factory(fmt)()
        layer.append(c, r)
        got_c, got_r = layer.read()
        s = slice(fmt.n_sink, 300 - fmt.recent)
        torch.testing.assert_close(got_c[:, s], fake_quantizer(fmt.content, 96)(c[:, s]), rtol=0, atol=0)
        torch.testing.assert_close(got_r[:, s], fake_quantizer(fmt.rope, 16)(r[:, s]), rtol=0, atol=0)
        assert layer.nbytes() == cache_bytes_per_token(fmt, 96, 16, 300, batch=2, act_bytes=4) * 600
        out[qz] = (float((got_c[:, s] - c[:, s]).pow(2).sum()), layer.nbytes(), fmt)
    assert out["lloyd"][0] < out["rtn"][0] * 0.8, out
    assert out["lloyd"][1] - out["rtn"][1] == 4 * 4 * 2 == out["lloyd"][2].codebook_bytes()
    bare = cache_format(quant_cfg("int2_joint", "quant.content.group_size=32", "quant.rope.quantizer=lloyd"), 96, 16)
    with pytest.raises(ValueError, match=r"quant.rope: quantizer=lloyd stores codes against a codebook fitted on "
                                         r"calibration latents, and this format has none"):
        layer_factory(bare)()
    assert dataclasses.replace(bare.rope, levels=None).codebook() is None


@pytest.mark.parametrize("quantizer", ["rtn", "hqq"])
def test_int2_joint_with_rope_groups_of_4_holds_the_peers_bytes(quantizer):
    """INT2 on both paths with a scale and zero per 4 RoPE channels, on the toy's dims (d_c 96 in groups of 32,
    d_r 16): 24 + 3 x 4 B of content, 4 + 4 x 4 B of RoPE key = 56 B per quantized token, as transformers' 2-bit
    QuantizedCache holds (int2_joint's whole-vector RoPE scale: 44 B); measured from the layer, equal to the formula,
    and the read-back is exactly fake_quantizer's values, the RoPE key closer to the latent than with one group."""
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(2, 50, 96, generator=g), 3 * torch.randn(2, 50, 16, generator=g)
    out = {}
    for rope_group in (None, 4):
        cfg = OmegaConf.merge(load_quant_option("int2_joint", groups={"wide": 32, "narrow": 32}),
                              {"protected": {"n_sink": 0, "recent": 0}, "content": {"quantizer": quantizer},
                               "rope": {"quantizer": quantizer, "group_size": rope_group}})
        fmt = cache_format(cfg, 96, 16)
        layer = cache_layer_factory(cfg, 96, 16)()
        layer.append(c, r)
        got_c, got_r = layer.read()
        torch.testing.assert_close(got_c, fake_quantizer(fmt.content, 96)(c), rtol=0, atol=0)
        torch.testing.assert_close(got_r, fake_quantizer(fmt.rope, 16)(r), rtol=0, atol=0)
        per_token = fmt.content.bytes_per_token(96) + fmt.rope.bytes_per_token(16)
        assert layer.nbytes() == per_token * 100
        out[rope_group] = (per_token, float((got_r - r).pow(2).sum() / r.pow(2).sum()))
    assert out[None][0] == 44 and out[4][0] == 56, out
    assert out[4][1] < out[None][1], out


def test_attention_sinks_reach_quantized_decode_and_the_kernels_are_refused(monkeypatch):
    """Hunyuan V4's attention sinks in a quantized cache: decode steps over the stored segments (the PyTorch decode
    path) give the logits of the same steps over the stored keys, and differ without the sinks; the decode kernels,
    which have no sinks, are refused by name when asked for."""
    from mla_quant.models.families import HYV4Family, MLAFamily

    # index_topk above the length: the indexer selects every token, so a decode step's mask hides padding only and
    # the step reads the stored segments
    model = build_model(compose("model=tiny_hy_v4", "model.config.index_topk=64").model)
    ids = torch.randint(3, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    q = quant_cfg("int4_joint", *TINY, "quant.mode=serving", "quant.backend=torch")

    def decode(segments: bool):
        monkeypatch.setattr(LatentCacheLayer, "_reads_segments",
                            lambda self, *a, real=LatentCacheLayer._reads_segments: segments and real(self, *a))
        with torch.no_grad():
            out = model.generate(ids, **cache_kwargs(quantized_cache(model, q)), max_new_tokens=4, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return torch.stack(out.logits)

    from mla_quant.cache import reads as layer_mod

    calls = []
    monkeypatch.setattr(layer_mod, "segment_attention",
                        lambda *a, real=layer_mod.segment_attention, **k: calls.append(k) or real(*a, **k))
    via_segments = decode(True)
    assert calls, "no decode step read the stored segments"
    torch.testing.assert_close(via_segments, decode(False), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(HYV4Family, "sinks", MLAFamily.sinks)
    assert (decode(True) - via_segments).abs().max() > 1e-2
    monkeypatch.undo()
    for backend in ("cpu", "triton"):
        with pytest.raises(ValueError, match=f"quant.backend={backend}: .*attention sinks.*hy_v4"):
            quantized_cache(model, quant_cfg("int4_joint", *TINY, f"quant.backend={backend}"))


def test_hybrid_stack_caches_latents_in_its_mla_layers_and_keeps_transformers_states_in_the_others():
    """Kimi Linear (KDA layers 0 and 2, MLA layers 1 and 3): latent cache layers only in the MLA slots, transformers'
    own linear-attention layers in the others, whose states equal those of transformers' DynamicCache run of the
    untouched model; a quantized cache changes the state of the KDA layer after an MLA layer and not the one before;
    bytes per token and layer count the MLA layers, the recurrent states apart; formats per layer are per MLA layer."""
    from transformers import DynamicCache

    from mla_quant.models.absorbed import absorb

    reference = build_model(compose("model=tiny_kimi_linear").model, absorbed=False)
    model = absorb(copy.deepcopy(reference))
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0

    def states(cache, slot):
        return cache.layers[slot].recurrent_states[0], cache.layers[slot].conv_states[0]

    with torch.no_grad():
        theirs = DynamicCache(config=reference.config)
        reference(ids, attention_mask=mask, use_cache=True, **cache_kwargs(theirs))
        ours = new_cache(model)
        model(ids, attention_mask=mask, **cache_kwargs(ours))
        q = quant_cfg("int4_joint", *TINY)
        quantized = quantized_cache(model, q)
        model(ids, attention_mask=mask, **cache_kwargs(quantized))
    assert [type(layer).__name__ for layer in ours.layers] == ["LinearAttentionLayer", "LatentCacheLayer"] * 2
    assert ours.latent_layers == [ours.layers[1], ours.layers[3]] and [m.layer_idx for m in ours.latent_layers] == [0, 1]
    for slot in (0, 2):
        for a, b in zip(states(ours, slot), states(theirs, slot)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(states(quantized, 0), states(ours, 0)):
        assert torch.equal(a, b)  # before any MLA layer
    assert (states(quantized, 2)[0] - states(ours, 2)[0]).abs().max() > 1e-4  # after the quantized MLA layer 0
    assert all(layer.n_quantized > 0 for layer in quantized.latent_layers)
    state = sum(t.numel() * t.element_size() for slot in (0, 2) for t in states(theirs, slot))
    assert ours.state_bytes() == quantized.state_bytes() == state
    held = HeldBytes()
    held.add(quantized)
    figures = held.metrics("cache")
    assert figures["cache/state_B_per_sequence"] == state / 2  # the batch's 2 sequences
    assert figures["cache/token_layers"] == 2 * (35 + 40)  # the real tokens of the 2 MLA layers
    assert ours.bytes_per_token_per_layer() == 4 * (32 + 8)  # float32 latents of the 2 MLA layers only
    with pytest.raises(ValueError, match="4 entries; the model has 2 cache layers"):
        quantized_cache(model, OmegaConf.merge(q, {"layers": [None] * 4}))
