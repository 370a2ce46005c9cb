"""The KIVI-style cache option (quant=kivi_int2 / kivi_int4): the content latent per channel over blocks of
`quant.content.token_block` tokens, the tokens of a block not yet full kept exact until it fills; round trips of
the codec and of the cache, exact bytes against the formula, per-sequence semantics under padding, crops and batch
edits, refusals (Triton backend, bad settings, the TurboQuant codec), and one small evaluation through run.py."""

import json

import pytest
import torch
from conftest import run_cli
from omegaconf import OmegaConf

from mla_quant.cache import cache_layer_factory
from mla_quant.cache.bytes import byte_table, load_quant_option, measure_bytes
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.quant.codecs.channel_block import channel_block_dequantize, channel_block_quantize
from mla_quant.quant.formats import PathFormat, cache_bytes_per_token, cache_format, fake_quantizer
from mla_quant.quant.quantizers import fake_quantize
from test_per_sequence import batches, logits_of  # the padded batches of the per-sequence tests

TOY_GROUPS = {"wide": 32, "narrow": 32}


def kivi(option="kivi_int2", **extra):
    return OmegaConf.merge(load_quant_option(option, groups=TOY_GROUPS), extra)


def block_reference(x, bits, block):
    """x (..., N, d), N whole blocks -> per-block channel quantize + dequantize (KIVI's key quantization)."""
    q = channel_block_quantize(x, bits, block)
    return channel_block_dequantize(q.codes, q.scales, q.zeros, bits)


# ---------------------------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("bits, d, block", [(2, 64, 8), (4, 96, 32), (3, 40, 16), (8, 24, 32)])
def test_codec_round_trip_equals_channel_block_quantizer(bits, d, block):
    fmt = PathFormat(format="channel_block", bits=bits, granularity="channel", token_block=block)
    fmt.check(d, "quant.content")
    x = torch.randn(3, 2 * block, d, generator=torch.Generator().manual_seed(bits))
    x[..., 1] *= 40.0  # an outlier channel: its own step per block
    parts = fmt.encode(x)
    assert all(v.shape[:2] == (3, 2 * block) for v in parts.values()), {k: v.shape for k, v in parts.items()}
    got = fmt.decode(parts, d, torch.float32)
    assert torch.equal(got, block_reference(x, bits, block))
    per_token = sum(v[0, 0].numel() * v.element_size() for v in parts.values())
    assert per_token == fmt.bytes_per_token(d), f"{per_token} B stored per token, formula {fmt.bytes_per_token(d)}"
    with pytest.raises(ValueError, match=rf"{block + 1} tokens are not whole blocks of token_block={block}"):
        fmt.encode(x[:, : block + 1])
    # per channel beats per token on the outlier channel at the same bits
    per_token_err = (fake_quantize(x, bits, None) - x).norm() / x.norm()
    assert (got - x).norm() / x.norm() < per_token_err


def test_fake_quantizer_quantizes_whole_blocks_and_keeps_the_tail_exact():
    cfg = kivi(content={"token_block": 8})
    fq = fake_quantizer(cfg.content, 96, path="content")
    x = torch.randn(2, 21, 96, generator=torch.Generator().manual_seed(1))
    y = fq(x)
    assert torch.equal(y[:, :16], block_reference(x[:, :16], 2, 8))
    assert torch.equal(y[:, 16:], x[:, 16:])
    # the cache with the protected region off reads the same values
    off = OmegaConf.merge(cfg, {"protected": {"n_sink": 0, "recent": 0}})
    layer = cache_layer_factory(off, 96, 16)()
    layer.append(x, torch.randn(2, 21, 16))
    assert torch.equal(layer.read()[0], y)


@pytest.mark.parametrize("change, match", [
    ({"content": {"token_block": 0}}, r"quant.content.token_block=0: format=channel_block needs the tokens per block"),
    ({"content": {"group_size": 32}}, r"quant.content.group_size=32: format=channel_block keeps one scale"),
    ({"content": {"symmetric": True}}, r"quant.content.symmetric=true: format=channel_block is asymmetric"),
    ({"content": {"granularity": "group"}},
     r"quant.content.granularity='group': format=channel_block takes \['channel'\]"),
    ({"rope": {"token_block": 32}}, r"quant.rope.token_block=32: format=int quantizes each token on its own"),
    ({"rope": {"format": "channel_block", "granularity": "channel", "token_block": 16}},
     r"quant.content.token_block=32 and quant.rope.token_block=16"),
    ({"backend": "triton"}, r"quant=kivi_int2: quant.content.format=channel_block: quant.backend=triton cannot read"),
])
def test_bad_settings_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        cache_format(kivi(**change), 96, 16)


def test_triton_backend_refused_before_any_weight():
    from conftest import compose

    from mla_quant.prepare import model_dims, validate

    cfg = compose(["experiment=evaluate", "quant=kivi_int2", "quant.backend=triton"])
    with pytest.raises(ValueError, match=r"quant=kivi_int2: quant.content.format=channel_block: quant.backend=triton"):
        validate(cfg, model_dims(cfg.model), quant=True)
    auto = compose(["experiment=evaluate", "quant=kivi_int2"])  # auto: decode steps in PyTorch
    validate(auto, model_dims(auto.model), quant=True)
    fmt = cache_format(auto.quant, 96, 16)
    assert fmt.step_backends("cuda") == {"prefill": "torch", "decode": "torch"}


def test_turboquant_codec_and_sensitivity():
    from conftest import compose

    from mla_quant.calibration import transformed_format
    from mla_quant.stages.sensitivity import noise_quantizers

    cfg = compose(["quant=kivi_int2", "transform=turboquant"])
    with pytest.raises(ValueError, match=r"quant=kivi_int2 stores content as channel_block"):
        transformed_format(cfg.transform, cache_format(cfg.quant, 96, 16))
    fq = noise_quantizers(compose(["experiment=sensitivity", "task.noise=quantizer", "quant=kivi_int2"]),
                          {"content": 96, "rope": 16})
    x = torch.randn(1, 70, 96, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fq["content"](x)[:, :64], block_reference(x[:, :64], 2, 32))


# ---------------------------------------------------------------------------------------------- the cache
def expected_read(c, r, n_sink, recent, block, bits=2):
    """What one sequence's cache reads after holding tokens c (L, d_c), r (L, d_r): sinks and recent exact, the
    whole blocks of the tokens between quantized per channel (RoPE INT4 per token), the rest of them exact."""
    length = c.shape[0]
    protected = min(length, n_sink + recent)
    left = length - protected
    full = left - left % block
    c, r = c.clone(), r.clone()
    if full:
        c[n_sink : n_sink + full] = block_reference(c[n_sink : n_sink + full], bits, block)
        r[n_sink : n_sink + full] = fake_quantize(r[n_sink : n_sink + full], 4, None)
    return c, r


@pytest.mark.parametrize("n_sink, recent, block", [(2, 5, 8), (0, 0, 8), (4, 32, 32)])
def test_cache_round_trip_in_odd_chunks_with_padding(n_sink, recent, block):
    cfg = kivi(protected={"n_sink": n_sink, "recent": recent}, content={"token_block": block}, block_size=16)
    layer = cache_layer_factory(cfg, 96, 16)()
    gen = torch.Generator().manual_seed(3)
    seqs = [([], []), ([], [])]
    for t in (1, 3, 7, 2, 11, 1, 1, 13, 5, 40, 1, 1):
        c, r = torch.randn(2, t, 96, generator=gen), torch.randn(2, t, 16, generator=gen)
        valid = torch.ones(2, t, dtype=torch.bool)
        valid[1, : t // 2] = False  # row 1 gets padding slots in every chunk
        layer.append(c, r, valid)
        for row in (0, 1):
            seqs[row][0].append(c[row][valid[row]])
            seqs[row][1].append(r[row][valid[row]])
        compact, lengths = layer.read_compact()
        for row in (0, 1):
            want_c, want_r = expected_read(torch.cat(seqs[row][0]), torch.cat(seqs[row][1]), n_sink, recent, block)
            n = int(lengths[row])
            assert n == want_c.shape[0]
            assert torch.equal(compact["content"][row, :n], want_c), f"row {row}, {n} tokens: content differs"
            assert torch.equal(compact["rope"][row, :n], want_r), f"row {row}, {n} tokens: rope differs"
            assert int(layer.n_pending[row]) == max(0, n - n_sink - recent) % block
        fresh, _ = layer._decode_all(torch.float32)  # the incremental view equals a full decode
        assert torch.equal(fresh["content"], compact["content"])


def test_crop_inside_a_block_and_batch_edits():
    cfg = kivi(protected={"n_sink": 2, "recent": 4}, content={"token_block": 8})
    layer = cache_layer_factory(cfg, 96, 16)()
    gen = torch.Generator().manual_seed(4)
    layer.append(torch.randn(2, 40, 96, generator=gen), torch.randn(2, 40, 16, generator=gen))
    before = layer.read()[0].clone()  # 2 sinks, 32 stored (4 blocks), 2 pending, 4 recent
    assert int(layer.store.lengths[0]) == 32 and int(layer.n_pending[0]) == 2
    layer.crop(-11)  # 4 recent, 2 pending, 5 stored tokens go: 27 stored -> 3 blocks + 3 pending (as stored)
    assert int(layer.store.lengths[0]) == 24 and int(layer.n_pending[0]) == 3 and int(layer.n_recent[0]) == 0
    assert torch.equal(layer.read()[0], before[:, :29])
    more_c, more_r = torch.randn(2, 9, 96, generator=gen), torch.randn(2, 9, 16, generator=gen)
    layer.append(more_c, more_r)  # 5 tokens join the 3 pending: a block of 8 is stored, 4 recent
    assert int(layer.store.lengths[0]) == 32 and int(layer.n_pending[0]) == 0
    after = layer.read()[0]
    assert torch.equal(after[:, :26], before[:, :26])
    assert torch.equal(after[:, 34:], more_c[:, 5:])
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.read()[0], after.flip(0))
    layer.batch_repeat_interleave(2)
    assert layer.read()[0].shape == (4, 38, 96) and torch.equal(layer.read()[0][1], after[1])


# ---------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("option", ["kivi_int2", "kivi_int4"])
def test_measured_bytes_equal_formula(option):
    fmt = cache_format(load_quant_option(option), 512, 64)
    per_quantized = fmt.content.bytes_per_token(512) + fmt.rope.bytes_per_token(64)
    assert per_quantized == {"kivi_int2": 128 + 64 + 36, "kivi_int4": 256 + 64 + 36}[option]
    contexts = (1, 100, 132, 133, 163, 164, 165, 1000, 4096)
    measured = measure_bytes(fmt, contexts, batch=2, chunk=97)
    for s, (used, held) in measured.items():
        assert used == 2 * cache_bytes_per_token(fmt, 512, 64, s) * s, f"{option} at {s}: {used} B measured"
        left = max(0, s - 132)
        assert used == 2 * ((132 + left % 32 if s > 132 else s) * 1152 + (left - left % 32) * per_quantized)
        block = 64 * per_quantized + 31 * 1152  # one partly filled paged block and the pending buffer
        assert used <= held <= used + 2 * block, f"{option} at {s}: held {held}, used {used}"


def test_cache_bytes_experiment_reports_kivi(tmp_path):
    from conftest import compose

    from mla_quant.stages import cache_bytes

    cfg = compose(["experiment=cache_bytes", "task.options=[kivi_int2,int2_content_int4_rope]",
                   "task.contexts=[4096,32768]", "task.chunk=1024"])
    result = cache_bytes.run(cfg, tmp_path)
    assert result.ok, result.message
    m = result.metrics
    for ctx in (4096, 32768):
        used = m[f"bytes/kivi_int2/ctx{ctx}/used_bytes_per_token_per_layer"]
        assert used == m[f"bytes/kivi_int2/ctx{ctx}/formula_bytes_per_token_per_layer"]
        left = ctx - 132
        assert used == ((132 + left % 32) * 1152 + (left - left % 32) * 228) / ctx
        assert 1.0 <= m[f"bytes/kivi_int2/ctx{ctx}/held_over_used"] <= 1.01
    rows = byte_table(["kivi_int4"], [300])
    assert rows[0]["used_B_per_token"] == rows[0]["formula_B_per_token"]
    assert "kivi_int2" in (tmp_path / "cache_bytes.md").read_text()


# ---------------------------------------------------------------------------------------------- per sequence
@pytest.fixture(scope="module")
def toy():
    from mla_quant.toy.model import load_toy_model

    return load_toy_model()


@pytest.mark.parametrize("protected", [{"recent": 32}, {"n_sink": 0, "recent": 0}])
def test_prompt_alone_equals_prompt_in_padded_batches(toy, protected):
    cfg = kivi(protected=protected)
    prompt, *padded = batches()
    alone = logits_of(toy, prompt, torch.ones_like(prompt), cfg)[0]
    for name, (ids, mask, rows) in zip(("left", "right"), padded):
        diff = float((logits_of(toy, ids, mask, cfg)[0, rows] - alone).abs().max())
        assert diff <= 1e-5, f"kivi_int2 {protected}: {name}-padded batch differs from the prompt alone by {diff:.3g}"
    exact = logits_of(toy, prompt, torch.ones_like(prompt), kivi("kivi_int2", content={"format": "bf16", "bits": 16,
                      "granularity": "group", "token_block": None}, rope={"format": "bf16", "bits": 16}))[0]
    assert float((exact - alone).abs().max()) > 1e-4  # the check is sharp: the quantized cache changes the logits


def test_greedy_decode_alone_equals_left_padded_batch(toy):
    cfg = kivi(protected={"recent": 8}, content={"token_block": 8})
    prompt, (ids, mask, _), _ = batches()
    runs = []
    for x, m in ((prompt, torch.ones_like(prompt)), (ids, mask)):
        out = toy.generate(x, attention_mask=m, max_new_tokens=20, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
                           **cache_kwargs(quantized_cache(toy, cfg)))
        runs.append((out.sequences[0, x.shape[1]:], torch.stack(out.scores)[:, 0]))
    assert torch.equal(runs[0][0], runs[1][0]), "greedy tokens depend on the padding"
    diff = float((runs[0][1] - runs[1][1]).abs().max())
    assert diff <= 1e-4, f"decode logits differ by {diff:.3g} (blocks fill during decode)"


# ---------------------------------------------------------------------------------------------- end to end
def test_evaluate_runs_with_kivi(tmp_path):
    run = run_cli("experiment=evaluate", "quant=kivi_int2", "eval.limit=2", "eval.data.niah_lengths=[256]",
                  "eval.tasks=[toy_niah_multikey_1]", "eval.control_no_rope.enabled=false", "logger=none",
                  f"hydra.run.dir={tmp_path}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["status"] == "ok" and record["choices"]["quant"] == "kivi_int2"
    assert any(k.startswith("eval/") for k in record["metrics"]), sorted(record["metrics"])
