"""The fused C++ CPU decode kernel (mla_quant/kernels/cpu_decode.py) against the kernels' PyTorch reference and the
layer's own decoded tokens, reading the quantized cache's stored tensors in place; the layers and the toy model
decoding through it (quant.backend=cpu, and auto on the CPU) against the PyTorch path; and its errors."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import HAS_CXX
from omegaconf import OmegaConf
from test_kernel import ENGINE_FORMATS, FORMATS, dense_attention, filled_layer

from mla_quant.cache import cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
from mla_quant.kernels import cpu_decode
from mla_quant.kernels.cpu_decode import latent_decode_cpu
from mla_quant.kernels.torch_decode import latent_decode_reference
from mla_quant.models.absorbed import cache_kwargs, quantized_cache

# Where a C++ compiler exists the kernel must build (a build that fails fails these tests); without one they skip.
pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
FORMATS = {**FORMATS, **ENGINE_FORMATS}
READ = [name for name in FORMATS if "pairs" not in name]  # every format but the RoPE key of several widths


def queries(b: int, heads: int, d_c: int, d_r: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, heads, d_c, generator=g), torch.randn(b, heads, d_r, generator=g)


@pytest.mark.parametrize("name", READ)
@pytest.mark.parametrize("heads", [1, 4, 7])
def test_cpu_kernel_matches_reference(name, heads):
    """Every format it reads, heads in blocks of 4 and singles, three sequences of different lengths (left padding),
    each split into several chunks (a chunk is at least 128 tokens)."""
    layer = filled_layer(dict(FORMATS[name]), d_c=96, d_r=16, batch=3, tokens=420, pads=(0, 9, 277), device="cpu")
    if name != "bf16 (plain layer)":
        assert layer.n_quantized > 0
    segments = layer.segments()
    q_latent, q_rope = queries(3, heads, 96, 16)
    out = latent_decode_cpu(q_latent, q_rope, 0.12, segments)
    ref = latent_decode_reference(q_latent, q_rope, 0.12, segments)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}, {heads} heads: {m}")
    torch.testing.assert_close(out, dense_attention(layer, q_latent, q_rope, 0.12), rtol=1e-4, atol=1e-5)


def test_cpu_kernel_reads_every_e4m3_code_and_odd_widths():
    """Every finite e4m3 byte as a token's value (scaled by E8M0 bytes), and e4m3 / e2m1 paths whose width is not a
    multiple of the group (one shorter group) or odd (e2m1: the last byte half used), against the reference."""
    from mla_quant.kernels.layout import PagedPath, Segment

    n = 254
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    g = torch.Generator().manual_seed(7)
    for kind, d, group, scales_as in (("e4m3", 5, 2, "e8m0"), ("e2m1", 5, 4, "e4m3"), ("e4m3", 3, 3, None)):
        row = -(-d * (8 if kind == "e4m3" else 4) // 8)
        data = torch.randint(0, 256, (n, 1, row), generator=g, dtype=torch.uint8)
        if kind == "e4m3":
            data[:, 0, 0] = codes  # every finite e4m3 code in channel 0
            data[data == 0x7F] = 0x7E  # no NaN elsewhere either
            data[data == 0xFF] = 0xFE
        groups = -(-d // group)
        if scales_as == "e8m0":
            scales = torch.randint(100, 150, (n, 1, groups), generator=g, dtype=torch.uint8)
        elif scales_as == "e4m3":
            scales = torch.randint(0x20, 0x60, (n, 1, groups), generator=g, dtype=torch.uint8)
        else:
            scales = torch.rand(n, 1, groups, generator=g).half()
        path = PagedPath(data, scales, None, 8 if kind == "e4m3" else 4, group, True, codes=kind, scales_as=scales_as)
        rope = PagedPath(torch.randn(n, 1, 2, generator=g))
        seg = Segment(path, rope, torch.arange(n, dtype=torch.int32)[None, :], torch.tensor([n], dtype=torch.int32))
        q_latent, q_rope = queries(1, 3, d, 2)
        torch.testing.assert_close(latent_decode_cpu(q_latent, q_rope, 0.3, [seg]),
                                   latent_decode_reference(q_latent, q_rope, 0.3, [seg]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{kind} d={d} g={group} {scales_as}: {m}")


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_at_real_dims_with_uneven_channels(threads):
    """d_c = 512 at 16 heads (vector lanes of 8, blocks of 4 heads) and a d_r of 20 (a tail of 4 channels), on 1 and
    2 threads: the same result as the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = filled_layer({"content": {"group_size": 128}, "rope": {"group_size": 20}}, d_c=512, d_r=20, batch=2,
                             tokens=600, pads=(0, 123), device="cpu")
        q_latent, q_rope = queries(2, 16, 512, 20, seed=threads)
        segments = layer.segments()
        torch.testing.assert_close(latent_decode_cpu(q_latent, q_rope, 0.07, segments),
                                   latent_decode_reference(q_latent, q_rope, 0.07, segments), rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def _row(segments, b: int):
    """Sequence b's part of every segment: its block table row and length (dense buffers: its row)."""
    out = []
    for seg in segments:
        if seg.rows:
            rows = lambda p: replace(p, data=p.data[b : b + 1])  # noqa: E731
            table = torch.zeros(1, 1, dtype=torch.int32)
            out.append(replace(seg, content=rows(seg.content), rope=rows(seg.rope), block_table=table,
                               lengths=seg.lengths[b : b + 1]))
        else:
            out.append(replace(seg, block_table=seg.block_table[b : b + 1].contiguous(),
                               lengths=seg.lengths[b : b + 1]))
    return out


def test_a_sequence_decodes_the_same_alone_and_in_a_batch():
    """Per-sequence semantics, bit for bit: a sequence's chunks follow its own length only."""
    layer = filled_layer({"content": {"group_size": 32}}, d_c=96, d_r=16, batch=3, tokens=700, pads=(0, 40, 500),
                         device="cpu")
    q_latent, q_rope = queries(3, 4, 96, 16)
    segments = layer.segments()
    batch = latent_decode_cpu(q_latent, q_rope, 0.1, segments)
    for b in range(3):
        alone = latent_decode_cpu(q_latent[b : b + 1], q_rope[b : b + 1], 0.1, _row(segments, b))
        assert torch.equal(alone[0], batch[b]), b


def test_cpu_kernel_reads_the_stored_codes_in_place():
    """Flipping one stored code moves the kernel's output exactly as it moves the reference's."""
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=1, tokens=160, device="cpu")
    q_latent, q_rope = queries(1, 4, 64, 16)
    before = latent_decode_cpu(q_latent, q_rope, 0.2, layer.segments())
    block = int(layer.store.block_table()[0, 0])
    layer.store.pool["content/codes"][block, 3] ^= 0xFF  # every nibble of token 3's first bytes changes
    segments = layer.segments()
    after = latent_decode_cpu(q_latent, q_rope, 0.2, segments)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, latent_decode_reference(q_latent, q_rope, 0.2, segments), rtol=1e-4, atol=1e-5)


def test_bf16_activations_and_an_empty_sequence():
    """bfloat16 queries and protected tokens (converted to float32 as read); a sequence with no token attends to
    nothing (zeros), as the reference says."""
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=2, tokens=150, dtype=torch.bfloat16,
                         device="cpu")
    q_latent, q_rope = (q.bfloat16() for q in queries(2, 4, 64, 16))
    segments = layer.segments()
    torch.testing.assert_close(latent_decode_cpu(q_latent, q_rope, 0.2, segments),
                               latent_decode_reference(q_latent, q_rope, 0.2, segments), rtol=1e-3, atol=1e-4)
    empty = [replace(seg, lengths=torch.tensor([0, int(seg.lengths[1])], dtype=seg.lengths.dtype)) for seg in segments]
    out = latent_decode_cpu(q_latent, q_rope, 0.2, empty)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], latent_decode_reference(q_latent, q_rope, 0.2, segments)[1], rtol=1e-3,
                               atol=1e-4)


def test_bad_inputs_are_named_before_the_call():
    layer = filled_layer({"content": {"group_size": 32}}, d_c=64, d_r=16, batch=2, tokens=150, device="cpu")
    q_latent, q_rope = queries(2, 4, 64, 16)
    good = layer.segments()[0]
    with pytest.raises(ValueError, match=r"segments\[0\].content.bits=3; allowed: \[0, 2, 4, 8\]"):
        latent_decode_cpu(q_latent, q_rope, 0.2, [replace(good, content=replace(good.content, bits=3))])
    with pytest.raises(ValueError, match=r"segments\[0\].block_table must be int32"):
        latent_decode_cpu(q_latent, q_rope, 0.2, [replace(good, block_table=good.block_table.long())])
    with pytest.raises(ValueError, match=r"segments is empty"):
        latent_decode_cpu(q_latent, q_rope, 0.2, [])
    pairs = filled_layer({"content": {"group_size": 32}, "rope": {"bits": [8, 2]}}, d_c=64, d_r=16, batch=2,
                         tokens=150, device="cpu").segments()
    with pytest.raises(ValueError, match=r"segments\[0\].rope: a path of several widths \(format=pairs\) is not read"):
        latent_decode_cpu(q_latent, q_rope, 0.2, pairs)


@pytest.mark.parametrize("override, match", [
    ({"rope": {"bits": [8, 4]}}, r"quant=int4_joint: quant.rope.format=pairs: quant.backend=cpu cannot read it"),
    ({"content": {"bits": 3}}, r"quant.content.bits=3.*quant.backend=cpu cannot read it"),
])
def test_formats_the_cpu_kernel_cannot_read_are_named(override, match):
    cfg = OmegaConf.merge(load_quant_option("int4_joint"), {"content": {"group_size": 32}}, override,
                          {"backend": "cpu"})
    with pytest.raises(ValueError, match=match):
        cache_layer_factory(cfg, 96, 16)


def test_a_kernel_that_does_not_build_is_named_or_skipped(monkeypatch):
    """backend=cpu where the kernel cannot build: an error naming the setting and why; backend=auto: a warning, and
    decode steps in PyTorch."""
    from mla_quant.cache import LatentCacheLayer
    from mla_quant.kernels import backends

    monkeypatch.setattr(cpu_decode, "_load", lambda: (None, "CalledProcessError: no compiler"))
    backends._usable.cache_clear()
    cfg = OmegaConf.merge(load_quant_option("int4_joint"), {"content": {"group_size": 32}})
    try:
        with pytest.raises(RuntimeError, match=r"quant.backend=cpu cannot run: the C\+\+ decode kernel .* did not "
                                               r"build here \(CalledProcessError: no compiler\)"):
            cache_layer_factory(OmegaConf.merge(cfg, {"backend": "cpu"}), 96, 16)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.warns(UserWarning, match=r"the cpu decode kernel is unavailable .*no compiler.*PyTorch"):
            layer = cache_layer_factory(cfg, 96, 16)()
        assert type(layer) is LatentCacheLayer
    finally:
        backends._usable.cache_clear()


@pytest.mark.parametrize("option", ["int4_joint", "int2_content_int4_rope", "bf16"])
def test_toy_model_decodes_the_same_through_the_cpu_kernel(option):
    """Greedy decode of the shipped toy model (batch of 2, left padding): quant.backend=cpu and auto (which takes
    the C++ kernel on the CPU) give the tokens and logits of the PyTorch path."""
    from mla_quant.tasks import niah
    from mla_quant.toy.model import load_toy_model, load_toy_tokenizer

    model, tok = load_toy_model(device="cpu"), load_toy_tokenizer()
    count = lambda s: len(tok(s).input_ids)  # noqa: E731
    prompts = [d["prompt"] for d in niah.test_set("single_2", [300], 2, seed=3, count_tokens=count)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # left padding is exercised
    runs = {}
    for backend in ("torch", "cpu", "auto"):
        cfg = OmegaConf.merge(load_quant_option(option),
                              {"backend": backend, "content": {"group_size": 32}, "protected": {"recent": 16}})
        cache = quantized_cache(model, cfg)
        runs[backend] = model.generate(**enc, max_new_tokens=3, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True, **cache_kwargs(cache))
        assert cache.backends_run() == {"prefill": "torch", "decode": "torch" if backend == "torch" else "cpu"}
    for backend in ("cpu", "auto"):
        assert torch.equal(runs["torch"].sequences, runs[backend].sequences), backend
        torch.testing.assert_close(torch.stack(runs[backend].scores), torch.stack(runs["torch"].scores), rtol=1e-4,
                                   atol=1e-4)


def test_a_stale_build_lock_does_not_hang_the_build(tmp_path):
    """A build killed midway leaves torch's lock in the build folder, on which every later build would wait forever:
    a lock older than STALE_LOCK_S is removed (with a warning) and the kernel loads. The folder is a copy of this
    machine's finished build (the build itself is what the other tests of this file run), so nothing recompiles."""
    import shutil
    import subprocess
    import sys
    import time

    assert cpu_decode.cpu_kernel_unavailable() is None  # built (or loaded) here, in the default extensions folder
    name, _ = cpu_decode._build_name()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    shutil.copytree(root / name, tmp_path / name, ignore=shutil.ignore_patterns("lock"))
    lock = tmp_path / name / "lock"
    lock.touch()
    old = time.time() - cpu_decode.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from mla_quant.kernels.cpu_decode import cpu_kernel_unavailable\n"
            "print('unavailable:', cpu_kernel_unavailable())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert out.returncode == 0 and "unavailable: None" in out.stdout, out.stderr[-2000:]
    assert "removing a stale build lock" in out.stderr
    assert not lock.exists() and list((tmp_path / name).glob("*.so"))
