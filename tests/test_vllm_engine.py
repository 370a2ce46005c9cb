"""vLLM itself serving an exported checkpoint with its latent cache in the project's formats
(mla_quant/serving/vllm_backend.py): the pages in vLLM's blocks read back as the project's cache reads them, what the
engine cannot store refused by name, and experiment=serve on the toy: the engine's greedy tokens equal the
framework's, and vLLM's block budget counts the format's bytes."""

import dataclasses
import json

import pytest
import torch
from conftest import HAS_CXX, compose, run_cli

from mla_quant.cache.layer import LatentCacheLayer
from mla_quant.kernels.layout import Segment
from mla_quant.kernels.torch_decode import segment_attention
from mla_quant.quant.format import as_spec
from mla_quant.quant.formats import cache_format

vllm_backend = pytest.importorskip("mla_quant.serving.vllm_backend", reason="vLLM's CPU build (README) is needed")
ENGINE = ["quant.mode=serving", "quant.protected.n_sink=0", "quant.protected.recent=0"]


def served(option: str, *overrides, dims=(96, 16)):
    cfg = compose(["model=toy_mla", f"quant={option}", *ENGINE, *overrides])
    return cache_format(cfg.quant, *dims, rope_layout="interleaved")


@pytest.mark.parametrize("dims", [(96, 16), (512, 64)], ids=["toy", "deepseek"])
@pytest.mark.parametrize("option, overrides", [("bf16", []), ("int4_joint", []), ("int2_content_int4_rope", []),
                                               ("int8_joint", []), ("int4_content", []), ("fp8_ds_mla", []),
                                               ("int4_joint", ["quant.content.bits=3"]), ("fp8_flat", [])])
def test_pages_in_vllm_blocks_read_as_the_cache_reads(option, overrides, dims):
    """Tokens written into slots of a vLLM-shaped block pool (blocks taken out of order) and read through a block
    table attend exactly as the project's own paged cache holding the same tokens, at the toy's and DeepSeek's
    latent dims (formats no decode kernel reads, 3-bit codes, through their codecs); the block's bytes are the
    format's bytes per token x block_size (16-byte aligned pages; with a scale per sequence, fp8_flat's, 16 bytes
    more, where the sequence's first block holds its scales as the framework's cache sets them)."""
    fmt = served(option, *overrides, dims=dims)
    d_c, d_r = dims
    pages = vllm_backend.EnginePages(fmt, 16, torch.float32)
    g = torch.Generator().manual_seed(0)
    length = 37
    content, rope = torch.randn(1, length, d_c, generator=g), torch.randn(1, length, d_r, generator=g)
    kv = torch.zeros(10, 1, 16, pages.token_bytes, dtype=torch.uint8)  # vLLM's (blocks, heads, block_size, bytes)
    table = torch.tensor([[3, 7, 1]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, i // 16]) * 16 + i % 16 for i in range(length)])
    scales = None
    if pages.scaled:  # the sequence's scales from its first append, kept in its first block
        first = pages.prompt_scales({"content": content[0], "rope": rope[0]})
        pages.set_sequence_scales(kv, table[:, 0], {p: x.reshape(1) for p, x in first.items()})
        scales = {p: x.expand(length) for p, x in first.items()}
    pages.write(kv, slots, {"content": content[0], "rope": rope[0]}, scales)
    q, q_rope = torch.randn(1, 4, d_c, generator=g), torch.randn(1, 4, d_r, generator=g)
    got = segment_attention(q, q_rope, 0.1, [pages.segment(kv, table, torch.tensor([length]))])
    layer = LatentCacheLayer(fmt)
    layer.append(content, rope)
    if fmt.kernel_unsupported() is None:  # the cache's own decode segments, read alike: exactly equal
        want = segment_attention(q, q_rope, 0.1, layer.segments())
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # the cache's tokens as stored, read back (a buffer of another width: float32 rounding apart)
        stored = [x.float() for x in layer.read()]
        want = segment_attention(q, q_rope, 0.1, [Segment.dense(*stored, torch.tensor([length]))])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if HAS_CXX and fmt.cpu_kernel_unsupported() is None:  # the C++ kernel the engine decodes with, on vLLM's pages
        from mla_quant.kernels.ops import decode_op

        seg = pages.segment(kv, table, torch.tensor([length]))
        torch.testing.assert_close(decode_op("cpu")(q, q_rope, 0.1, [seg]), want, rtol=1e-5, atol=1e-5)
    exact = 16 * sum(fmt.path(p).bytes_per_token(fmt.dim(p), 4) for p in ("content", "rope"))
    assert exact <= pages.block_bytes < exact + 2 * 16 and pages.token_bytes * 16 >= pages.block_bytes


def _engine_layer(fmt, block_size: int = 16, slots: int = 4, cls=None):
    """The backend's layer for one format (`cls`: the CPU backend's implementation unless named), without an
    engine: what its decode reads and writes need."""
    from mla_quant.quant.format import as_spec

    cls = cls or vllm_backend.LatentMLAImpl
    impl = cls.__new__(cls)
    impl.__dict__.update(fmt=fmt, served=as_spec(fmt), block_size=block_size, max_num_seqs=slots,
                         act_dtype=torch.float32, slot_table=vllm_backend.SlotTable(slots), kv_lora_rank=fmt.d_c,
                         qk_rope_head_dim=fmt.d_r)
    return impl


@pytest.mark.parametrize("option, extra", [("int4_joint", []), ("int2_content_int4_rope", []),
                                           ("int4_joint", ["quant.content.bits=3"])])
def test_protected_region_in_the_engine_reads_as_the_cache_reads(option, extra):
    """Sequences of 37, 5, 11 and 18 tokens in vLLM-shaped blocks (taken out of order) with 2 sinks and the 8 latest
    tokens also in the protected pool, then a decode step each (its token fresh, as the engine reads it): the decode
    segments attend exactly as the project's own cache holding the same tokens with the same protected region, through
    the PyTorch path and the C++ kernel. A sequence whose slot was taken reads every token as stored (counted); sinks
    that do not fit a sequence's first block are refused by name."""
    fmt = served(option, "quant.protected.n_sink=2", "quant.protected.recent=8", *extra)  # 3-bit: no kernel reads it
    impl, g = _engine_layer(fmt), torch.Generator().manual_seed(0)
    lengths = [37, 5, 11, 18]
    kv = torch.zeros(16, 1, 16, impl.pages.token_bytes, dtype=torch.uint8)
    table = torch.tensor([[3, 7, 1], [9, 0, 0], [4, 0, 0], [12, 2, 0]], dtype=torch.int32)
    tokens = [torch.randn(n + 1, 96 + 16, generator=g) for n in lengths]  # each with its decode step's token
    q, q_rope = torch.randn(4, 4, 96, generator=g), torch.randn(4, 4, 16, generator=g)

    def write(rows, start):  # one step: these rows' tokens at these positions (a prompt whole, or one token each)
        pos = torch.cat([torch.arange(a, b) for a, b in rows])
        row = torch.cat([torch.full((b - a,), r) for r, (a, b) in enumerate(rows)])
        x = torch.cat([tokens[r][a:b] for r, (a, b) in enumerate(rows)])
        slots = table[row, pos // 16].long() * 16 + pos % 16
        impl.pages.write(kv, slots, {"content": x[:, :96], "rope": x[:, 96:]})
        idx = torch.tensor(impl.pool.assign(table[:, 0].tolist(), [start] * len(rows)))
        ends = torch.tensor([b for _, b in rows])
        impl.pool.write(idx[row], pos, x, ends[row])
        impl._slots = idx

    def decode(stored, fresh=None):  # the engine's decode segments against the cache's own, row by row
        segments = impl._protected_segments(kv, table, torch.tensor(stored), torch.float32)
        fresh = torch.stack([tokens[r][n] for r, n in enumerate(stored)])[:, None]
        segments.append(Segment.dense(fresh[..., :96].contiguous(), fresh[..., 96:].contiguous(),
                                      torch.ones(4, dtype=torch.int32)))
        got = segment_attention(q, q_rope, 0.1, segments)
        if HAS_CXX and fmt.cpu_kernel_unsupported() is None:
            from mla_quant.kernels.ops import decode_op

            torch.testing.assert_close(decode_op("cpu")(q, q_rope, 0.1, segments), got, rtol=1e-5, atol=1e-5)
        return got

    def cache(r, n, protected=fmt, fresh=False):  # the cache's own read of n tokens (and token n read fresh)
        layer = LatentCacheLayer(protected)
        layer.append(tokens[r][None, :n, :96], tokens[r][None, :n, 96:])
        held = layer.segments() if fmt.kernel_unsupported() is None else \
            [Segment.dense(*(x.float() for x in layer.read()), torch.tensor([n]))]  # as stored, read back
        extra = [Segment.dense(tokens[r][None, n:n + 1, :96], tokens[r][None, n:n + 1, 96:],
                               torch.ones(1, dtype=torch.int32))] if fresh else []
        return segment_attention(q[r:r + 1], q_rope[r:r + 1], 0.1, [*held, *extra])

    write([(0, n) for n in lengths], True)  # the prompts (each with its last token: its first decode step's)
    got = decode([n - 1 for n in lengths])
    for r, n in enumerate(lengths):
        torch.testing.assert_close(got[r:r + 1], cache(r, n), rtol=1e-6, atol=1e-6, msg=f"prompt {n}")
    write([(n, n + 1) for n in lengths], False)  # one decode step each: the window moves on
    got = decode(lengths)
    for r, n in enumerate(lengths):
        torch.testing.assert_close(got[r:r + 1], cache(r, n + 1), rtol=1e-6, atol=1e-6, msg=f"step at {n}")
    assert impl.pool.table.misses == 0
    impl.pool.table.owner[impl.pool.table.slot_of.pop(int(table[0, 0]))] = None  # sequence 0's slot taken while it waited
    impl._slots = torch.tensor(impl.pool.assign(table[:, 0].tolist(), [False] * 4))
    assert impl.pool.table.misses == 1
    unprotected = dataclasses.replace(fmt, n_sink=0, recent=0)
    torch.testing.assert_close(decode(lengths)[:1], cache(0, lengths[0], unprotected, fresh=True), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(ValueError, match=r"quant.protected.n_sink=20 sinks do not fit a sequence's first block "
                                         r"\(block_size 16\); allowed: n_sink <= block_size"):
        _engine_layer(dataclasses.replace(fmt, n_sink=20)).pool


def _drive(monkeypatch, impl, table, kv):
    """A function running one engine step of `impl` (the layer's cache update with the step's metadata, as vLLM's
    fields) over rows [(tokens (n, d_c + d_r), first position)], row r the sequence of table row r: one token each
    (the `decodes` decode rows first), then prompts from position 0 or, with chunked prefill, from their cached
    context on; it returns the step's metadata."""
    from types import SimpleNamespace

    import vllm.forward_context

    monkeypatch.setattr(vllm_backend, "MLACommonMetadata", SimpleNamespace)
    impl.__dict__.setdefault("layer_name", "model.layers.0.self_attn.attn")

    def step(rows: list, decodes: int):
        pos = torch.cat([torch.arange(a, a + len(x)) for x, a in rows])
        row = torch.cat([torch.full((len(x),), r) for r, (x, _) in enumerate(rows)])
        x = torch.cat([x for x, _ in rows])
        starts = torch.tensor([0, *torch.tensor([len(x) for x, _ in rows]).cumsum(0).tolist()])
        seq_lens = torch.tensor([a + len(x) for x, a in rows[:decodes]])
        context = [a for _, a in rows[decodes:]]
        chunked = SimpleNamespace(context_lens_list=context) if any(context) else None
        prefill = SimpleNamespace(block_table=table[decodes:len(rows)], chunked_context=chunked,
                                  query_lens_cpu=torch.tensor([len(x) for x, _ in rows[decodes:]]))
        meta = SimpleNamespace(num_actual_tokens=len(x), num_decodes=decodes, num_decode_tokens=decodes,
                               num_reqs=len(rows), num_prefills=len(rows) - decodes, query_start_loc=starts,
                               prefill=None if decodes == len(rows) else prefill,
                               decode=SimpleNamespace(block_table=table[:decodes], seq_lens=seq_lens))
        context = SimpleNamespace(attn_metadata={impl.layer_name: meta})
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
        slots = table[row, pos // 16].long() * 16 + pos % 16
        d_c = impl.fmt.d_c
        impl.do_kv_cache_update(x[:, :d_c], x[:, None, d_c:], kv, slots, "auto", None)
        return meta

    return step


def test_a_scale_per_sequence_is_set_from_its_prompt_and_read_from_its_first_block(monkeypatch):
    """fp8_flat in the engine (one fp8 scale per sequence and layer, set by its first append): a prefill step of
    two prompts (37 and 5 tokens, of different ranges) and then a decode step each, through the layer's cache update
    with the step's metadata: each sequence's scale is its prompt's amax / 448, held in its first block, and its
    tokens read back as the framework's cache holds them."""
    from mla_quant.quant.formats import tensor_scale_for

    fmt = served("fp8_flat")
    impl, g = _engine_layer(fmt), torch.Generator().manual_seed(0)
    lengths = [37, 5]
    table = torch.tensor([[3, 7, 1], [9, 0, 0]], dtype=torch.int32)
    kv = torch.zeros(16, 1, 16, impl.pages.token_bytes, dtype=torch.uint8)
    tokens = [torch.randn(n + 1, 96 + 16, generator=g) * (4 * r + 1) for r, n in enumerate(lengths)]
    step = _drive(monkeypatch, impl, table, kv)

    step([(tokens[r][:n], 0) for r, n in enumerate(lengths)], 0)
    held = impl.pages.sequence_scales(kv, table[:, 0].long())
    for r, n in enumerate(lengths):
        want = tensor_scale_for(tokens[r][:n, :96], tokens[r][:n, 96:])  # joint over both paths (shared_scale)
        assert float(held["content"][r]) == float(held["rope"][r]) == float(want)
    step([(tokens[r][n:], n) for r, n in enumerate(lengths)], 2)
    dense = impl.pages.decoded(kv, table)
    for r, n in enumerate(lengths):
        layer = LatentCacheLayer(fmt)
        layer.append(tokens[r][None, :n, :96], tokens[r][None, :n, 96:])
        layer.append(tokens[r][None, n:, :96], tokens[r][None, n:, 96:])
        for path, stored in zip(("content", "rope"), layer.read()):
            torch.testing.assert_close(dense[path][r, :n + 1], stored[0].float(), rtol=0, atol=0)


def test_a_one_token_prompt_starts_its_sequence(monkeypatch):
    """vLLM runs a prompt of one token as a decode row (a step of one query token). It is still its sequence's first
    step: its pool slot is assigned afresh (no slot counted lost) and, with a scale per sequence, its token sets the
    scale it is stored with."""
    from mla_quant.quant.formats import tensor_scale_for

    g = torch.Generator().manual_seed(0)
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    token = torch.randn(1, 112, generator=g) * 3
    for option, extra in (("fp8_flat", []), ("int2_joint", ["quant.protected.n_sink=2", "quant.protected.recent=8"])):
        impl = _engine_layer(served(option, *extra))
        kv = torch.zeros(8, 1, 16, impl.pages.token_bytes, dtype=torch.uint8)
        _drive(monkeypatch, impl, table, kv)([(token, 0)], 1)
        if impl.pool is not None:
            assert impl.pool.table.misses == 0 and impl.pool.sinks_held.tolist()[impl._slots[0]] == 1
        else:
            held = impl.pages.sequence_scales(kv, table[:, 0].long())
            assert float(held["content"][0]) == float(tensor_scale_for(token[:, :96], token[:, 96:]))


def test_a_steps_tokens_are_written_by_their_count_and_each_needs_a_slot(monkeypatch):
    """The cache update writes a step's tokens by their count (vLLM's padding comes after them), without reading
    which slots are valid on the host: a step's token without a slot (-1) fails, checked on the device, rather than
    being written into the cache's last block; padding slots after the step's tokens are written nowhere."""
    g = torch.Generator().manual_seed(0)
    impl = _engine_layer(served("int4_joint"))
    kv = torch.zeros(8, 1, 16, impl.pages.token_bytes, dtype=torch.uint8)
    tokens = torch.randn(5, 112, generator=g)
    step = _drive(monkeypatch, impl, torch.tensor([[5, 2]], dtype=torch.int32), kv)
    meta = step([(tokens, 0)], 0)
    padded = torch.cat([torch.arange(80, 85), torch.full((3,), -1)])  # the step's 5 tokens, then 3 padding slots
    before = kv.clone()
    impl.do_kv_cache_update(torch.cat([tokens[:, :96], torch.zeros(3, 96)]),
                            torch.cat([tokens[:, None, 96:], torch.zeros(3, 1, 16)]), kv, padded, "auto", None)
    assert torch.equal(kv, before) and meta.num_actual_tokens == 5  # the same bytes again; the last block untouched
    with pytest.raises(RuntimeError, match="a step's token without a cache slot"):
        impl.do_kv_cache_update(tokens[:, :96], tokens[:, None, 96:], kv, torch.tensor([80, 81, -1, 83, 84]), "auto",
                                None)


@pytest.mark.parametrize("option", ["kivi_int4", "kivi_int2"])
@pytest.mark.parametrize("protected, lengths", [((2, 8), [45, 5, 73, 41]), ((0, 0), [31, 5, 64, 40])],
                         ids=["sinks+window", "none"])
def test_a_token_block_waits_in_the_pool_and_is_stored_when_it_fills(monkeypatch, option, protected, lengths):
    """KIVI in the engine (content per channel over 32-token blocks): prompts of whole and partial blocks, then three
    decode steps each, through the layer's cache update with the step's metadata. A block is encoded into its tokens'
    slots when its last token leaves the window (from the prompt, or from the pool's ring in a decode step: the
    41-token and 31-token sequences fill one there, the latter with the step's own token, read fresh), the tokens
    after the last whole block are read from the pool as they are; each decode step attends exactly as the
    framework's cache holding the same tokens. The pool holds n_sink + recent + 32 tokens per sequence; a sequence
    whose slot was taken while it waited (its pending tokens lost) is refused by name."""
    n_sink, recent = protected
    fmt = served(option, f"quant.protected.n_sink={n_sink}", f"quant.protected.recent={recent}")
    impl, g = _engine_layer(fmt), torch.Generator().manual_seed(0)
    assert impl.pool.nbytes == impl.pool_bytes == 4 * (n_sink + recent + 32) * 112 * 4
    table = torch.randperm(24, generator=g)[:20].reshape(4, 5).to(torch.int32)  # blocks out of order
    kv = torch.full((24, 1, 16, impl.pages.token_bytes), 255, dtype=torch.uint8)  # unwritten slots: not zeros
    tokens = [torch.randn(n + 3, 112, generator=g) for n in lengths]  # each with its three decode steps' tokens
    q, q_rope = torch.randn(4, 4, 96, generator=g), torch.randn(4, 4, 16, generator=g)
    step = _drive(monkeypatch, impl, table, kv)
    step([(tokens[r][:n], 0) for r, n in enumerate(lengths)], 0)
    for k in range(3):
        at = [n + k for n in lengths]
        step([(tokens[r][n:n + 1], n) for r, n in enumerate(at)], 4)
        segments = impl._protected_segments(kv, table, torch.tensor(at), torch.float32)
        fresh = torch.stack([tokens[r][n] for r, n in enumerate(at)])[:, None]
        got = segment_attention(q, q_rope, 0.1, [*segments, Segment.dense(fresh[..., :96].contiguous(),
                                                                          fresh[..., 96:].contiguous(),
                                                                          torch.ones(4, dtype=torch.int32))])
        for r, n in enumerate(at):
            layer = LatentCacheLayer(fmt)
            layer.append(tokens[r][None, :n + 1, :96], tokens[r][None, :n + 1, 96:])
            content, rope = (x.float().clone() for x in layer.read())
            content[0, n], rope[0, n] = tokens[r][n, :96], tokens[r][n, 96:]  # the step's own token: fresh
            want = segment_attention(q[r:r + 1], q_rope[r:r + 1], 0.1,
                                     [Segment.dense(content, rope, torch.tensor([n + 1], dtype=torch.int32))])
            torch.testing.assert_close(got[r:r + 1], want, rtol=1e-6, atol=1e-6, msg=f"step {k}, {n} stored")
    impl.pool.table.owner[impl.pool.table.slot_of.pop(int(table[0, 0]))] = None  # sequence 0's slot taken meanwhile
    impl._slots = torch.tensor(impl.pool.assign(table[:, 0].tolist(), [False] * 4))
    with pytest.raises(RuntimeError, match=r"a sequence's tokens waiting for their token block \(token_block=32\) "
                                           r"were lost: its protected pool slot was taken"):
        impl._protected_segments(kv, table, torch.tensor([n + 3 for n in lengths]), torch.float32)


@pytest.mark.parametrize("option, protected", [("int4_joint", (0, 0)), ("int2_joint", (2, 8)), ("fp8_flat", (0, 0)),
                                               ("kivi_int2", (2, 8)), ("kivi_int4", (0, 0))])
def test_a_prompt_continued_by_chunked_prefill_reads_its_context_as_the_cache_reads_it(monkeypatch, option,
                                                                                        protected):
    """Chunked prefill: four prompts written 16, 7, 11 and 23 tokens per engine step, four steps, through the layer's
    cache update with each step's metadata (a prompt continued over its cached context). The context each chunk
    attends to (`_context`: its tokens as stored, the protected ones from the pool; KIVI's blocks stored when they
    fill, mid-chunk or across chunks, and its tokens waiting for their block read from the ring) equals, bit for bit,
    what the framework's cache holds once it has appended the same chunks one by one (fp8_flat: the scale its first
    chunk set)."""
    n_sink, recent = protected
    fmt = served(option, f"quant.protected.n_sink={n_sink}", f"quant.protected.recent={recent}")
    impl, g = _engine_layer(fmt), torch.Generator().manual_seed(0)
    chunks = [16, 7, 11, 23]
    table = torch.randperm(32, generator=g)[:24].reshape(4, 6).to(torch.int32)  # blocks out of order
    kv = torch.full((32, 1, 16, impl.pages.token_bytes), 255, dtype=torch.uint8)  # unwritten slots: not zeros
    tokens = [torch.randn(4 * c, 112, generator=g) * (r + 1) for r, c in enumerate(chunks)]
    step = _drive(monkeypatch, impl, table, kv)
    for k in range(4):
        meta = step([(tokens[r][k * c:(k + 1) * c], k * c) for r, c in enumerate(chunks)], 0)
        if not k:
            assert meta.prefill.chunked_context is None
            continue
        context = impl._context(kv, meta, torch.float32)
        for r, c in enumerate(chunks):
            layer = LatentCacheLayer(fmt)
            for j in range(k + 1):  # the framework's cache, appended chunk by chunk
                layer.append(tokens[r][None, j * c:(j + 1) * c, :96], tokens[r][None, j * c:(j + 1) * c, 96:])
            want = torch.cat([x[0, : k * c].float() for x in layer.read()], -1)
            torch.testing.assert_close(context[r], want, rtol=0, atol=0, msg=f"chunk {k} of sequence {r}")
    if fmt.token_block:  # the blocks stored are read as the framework stores them (pages, past the pool's ring)
        assert impl.pool.whole_blocks(torch.tensor([4 * c for c in chunks])).tolist() == \
            ([1, 0, 1, 2] if n_sink else [2, 0, 1, 2])


@pytest.mark.parametrize("option, protected", [("int4_joint", (0, 0)), ("int2_content_int4_rope", (2, 8)),
                                               ("fp8_flat", (0, 0)), ("kivi_int2", (2, 8))])
def test_the_gpu_backend_serves_the_steps_as_the_cpu_backend_does(monkeypatch, option, protected):
    """The GPU backend's layer (`LatentTritonMLAImpl`: vLLM's Triton MLA implementation with the format's writes and
    reads) against the CPU backend's, through the same engine steps: four prompts (45, 5, 11 and 18 tokens) cut into
    chunks (KIVI's first block filling mid-chunk), the short ones decoding while the long ones continue, then a
    decode step each. Its decode goes through the kernel a CUDA device gets (`step_backends("cuda")`: the Triton
    kernel where it reads the format, here in its CPU interpreter; PyTorch otherwise); its writes, chunked context
    and decode run under the stray-device audit (a tensor made without naming its device fails there, as a CPU
    tensor inside a CUDA step fails on a GPU). The decode outputs match the CPU backend's (C++ kernel or PyTorch)
    and the chunked context is equal, bit for bit."""
    from mla_quant.audit import audited

    n_sink, recent = protected
    fmt = served(option, f"quant.protected.n_sink={n_sink}", f"quant.protected.recent={recent}")
    g = torch.Generator().manual_seed(0)
    lengths, first = [45, 5, 11, 18], [20, 5, 11, 9]
    table = torch.randperm(32, generator=g)[:16].reshape(4, 4).to(torch.int32)  # blocks out of order
    tokens = [torch.randn(n + 2, 112, generator=g) for n in lengths]  # each with its decode steps' tokens
    q, q_rope = torch.randn(4, 4, 96, generator=g), torch.randn(4, 4, 16, generator=g)
    gpu = _engine_layer(fmt, cls=vllm_backend.LatentTritonMLAImpl)
    cpu = _engine_layer(fmt)
    gpu.scale = cpu.scale = 0.1
    gpu.decode_backend = lambda device_type: fmt.step_backends("cuda")["decode"]  # the kernel a GPU decodes with
    assert gpu.decode_backend("cpu") == ("triton" if fmt.kernel_unsupported() is None else "torch")
    gpu.do_kv_cache_update = audited(gpu.do_kv_cache_update)
    outs = {}
    for name, impl in (("gpu", gpu), ("cpu", cpu)):
        kv = torch.full((32, 1, 16, impl.pages.token_bytes), 255, dtype=torch.uint8)  # unwritten slots: not zeros
        work = audited if name == "gpu" else (lambda fn: fn)
        got = []
        order = [0, 1, 2, 3]
        step = _drive(monkeypatch, impl, table[order], kv)
        step([(tokens[r][:first[r]], 0) for r in order], 0)  # the prompts' first chunks
        order = [1, 2, 0, 3]  # the short prompts done: they decode, decode rows first; the long ones continue
        step = _drive(monkeypatch, impl, table[order], kv)
        meta = step([(tokens[1][5:6], 5), (tokens[2][11:12], 11), (tokens[0][20:45], 20), (tokens[3][9:18], 9)], 2)
        got += work(impl._context)(kv, meta, torch.float32)
        got.append(work(impl.forward_mqa)((q[:2], q_rope[:2]), kv, meta, None)[0])
        order = [0, 1, 2, 3]
        step = _drive(monkeypatch, impl, table[order], kv)
        at = [45, 6, 12, 18]
        meta = step([(tokens[r][n:n + 1], n) for r, n in zip(order, at)], 4)
        got.append(work(impl.forward_mqa)((q, q_rope), kv, meta, None)[0])
        outs[name] = got
    for k, (a, b) in enumerate(zip(outs["gpu"], outs["cpu"])):
        exact = k < 2  # the chunked context: the same bytes decoded alike
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5, msg=f"output {k}")


def test_blocks_are_shared_only_where_no_sequence_owns_what_they_hold():
    """vLLM's prefix caching shares a prompt's leading blocks between sequences: allowed for a format whose blocks hold
    their tokens alone, refused by name where a sequence's first block finds its pool or holds its scale."""
    assert vllm_backend.shared_blocks_refused(as_spec(served("int4_joint"))) is None
    assert vllm_backend.shared_blocks_refused(as_spec(served("fp8_ds_mla"))) is None
    assert "scale is held in its first block" in vllm_backend.shared_blocks_refused(as_spec(served("fp8_flat")))
    for option, extra in (("kivi_int4", []), ("int2_joint", ["quant.protected.n_sink=2"])):
        assert "protected pool" in vllm_backend.shared_blocks_refused(as_spec(served(option, *extra)))


def test_the_layers_pools_share_one_slot_table_and_sinks_are_checked_at_engine_start(monkeypatch):
    """Every layer's pool holds the engine's sequences in the same slots, assigned once per step (the step's
    forward context, one object for all layers); each pool empties the slots that start afresh. Sinks wider than a
    block are refused when vLLM sizes its pages, before any step."""
    from types import SimpleNamespace

    fmt = served("int4_joint", "quant.protected.n_sink=2", "quant.protected.recent=8")
    table = vllm_backend.SlotTable(4)
    pools = [vllm_backend.ProtectedPool(2, 8, 112, table, torch.float32) for _ in range(3)]
    step = object()
    got = [pool.assign([5, 9, 2], [True, True, True], step=step) for pool in pools]
    assert got[0] == got[1] == got[2] and len(set(got[0])) == 3 and table.step == 1
    for pool in pools:
        pool.window_pos[got[0][0]] = 7  # a token held by sequence 5 in every layer
        pool.sinks_held[got[0][0]] = 2
    again = object()  # the next step: sequence 5 recomputed from its prompt (preempted), 9 decodes
    got2 = [pool.assign([9, 5], [False, True], step=again) for pool in pools]
    assert got2[0] == got2[1] == [got[0][1], got[0][0]] and table.step == 2
    assert all(int(pool.sinks_held[got[0][0]]) == 0 and bool((pool.window_pos[got[0][0]] == -1).all())
               for pool in pools)

    wide = vllm_backend.as_spec(dataclasses.replace(fmt, n_sink=20))
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(vllm_backend, "current_format", lambda: (wide, config))
    with pytest.raises(ValueError, match=r"n_sink=20 sinks do not fit a sequence's first block \(block_size 16\)"):
        vllm_backend.LatentMLABackend.customize_spec(SimpleNamespace(block_size=16))


def test_the_protected_pools_come_out_of_the_engines_budget():
    """A layer's pool holds max_num_seqs x (n_sink + recent) tokens of d_c + d_r values in the activation dtype; the
    engine's worker gives vLLM's blocks the KV cache's bytes less every layer's pool (whoever starts the engine), and
    refuses a budget the pools fill by name; experiment=serve refuses one before anything starts."""
    from types import SimpleNamespace

    from mla_quant.quant.format import as_spec
    from mla_quant.stages.serve import check_pools_fit

    fmt = as_spec(served("int4_joint", "quant.protected.n_sink=2", "quant.protected.recent=8"))
    pool = 16 * (2 + 8) * (96 + 16) * 4
    layers = [_engine_layer(fmt.uniform, slots=16) for _ in range(4)]
    assert layers[0].pool.nbytes == layers[0].pool_bytes == pool
    assert vllm_backend.pool_bytes(fmt, 16, torch.float32, 4) == 4 * pool

    class Worker:  # vLLM's worker as the wrapper sees it: the memory it measured, and its config
        def determine_available_memory(self):
            return self.budget

    context = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(impl=impl) for i, impl in enumerate(layers)}
    context["model.lm_head"] = SimpleNamespace()  # not an attention layer
    config = SimpleNamespace(parallel_config=SimpleNamespace(worker_cls=Worker),
                             compilation_config=SimpleNamespace(static_forward_context=context),
                             scheduler_config=SimpleNamespace(max_num_seqs=16))
    vllm_backend.count_pools(config)
    vllm_backend.count_pools(config)  # once per process, however many layers ask
    worker = Worker()
    worker.vllm_config, worker.budget = config, 1048576
    assert worker.determine_available_memory() == 1048576 - 4 * pool
    worker.budget = 4 * pool
    with pytest.raises(ValueError, match=rf"the protected region's pools take {4 * pool} bytes for max_num_seqs=16 "
                                         rf"sequences, and the KV cache has {4 * pool}"):
        worker.determine_available_memory()
    worker.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    assert worker.determine_available_memory() == 4 * pool  # a model without pools: as measured

    check_pools_fit(compose(["experiment=serve", "task.max_num_seqs=16"]).task, fmt, 4)
    with pytest.raises(ValueError, match=rf"task.kv_budget_bytes=1048576: the protected region of quant=int4_joint "
                                         rf"\(n_sink 2, recent 8\) takes {4 * 256 * 10 * 112 * 4} bytes for "
                                         rf"task.max_num_seqs=256 sequences"):
        check_pools_fit(compose(["experiment=serve"]).task, fmt, 4)


def test_an_exported_checkpoint_gets_the_backend_that_serves_it_on_a_cpu_with_amx(tmp_path, monkeypatch):
    """On a CPU with AMX, vLLM's CPU platform gives an MLA model AMX_MLA (vLLM's own cache, 128-token blocks, chunked
    prefill) unless CPU_MLA is asked for: the plugin asks for CPU_MLA for a folder holding the cache description, so
    vLLM's CPU MLA block size follows (16 tokens) and chunked prefill and prefix caching stay as the engine was asked
    (the platform turns both off for every model on its CPU MLA backends; this backend reads a prompt's context in the
    format), prefix caching only where sequences can share the format's blocks (not with a protected region's pool);
    leaves any other folder as vLLM sets it, and refuses another backend asked for a checkpoint by name."""
    import shutil

    from omegaconf import OmegaConf

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_quant.serving import CACHE_FILE
    from mla_quant.serving.vllm_plugin import register
    from mla_quant.toy.model import ASSETS

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    register()
    plain, ours, pooled = tmp_path / "plain", tmp_path / "ours", tmp_path / "pooled"
    for folder in (plain, ours, pooled):
        folder.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ASSETS / name, folder / name)
    for folder, overrides in ((ours, []), (pooled, ["quant.protected.n_sink=2", "quant.protected.recent=8"])):
        quant = compose(["model=toy_mla", "quant=int4_joint", *ENGINE, *overrides]).quant
        (folder / CACHE_FILE).write_text(json.dumps({"quant": OmegaConf.to_container(quant, resolve=True),
                                                     "cache": {"format": "int4_joint", "d_c": 96, "d_r": 16}}))

    def config(folder, **kwargs):
        return EngineArgs(model=str(folder), hf_overrides={"architectures": ["DeepseekV2ForCausalLM"]},
                          runner="generate", enforce_eager=True, dtype="float32", max_model_len=256,
                          **kwargs).create_engine_config()

    served = config(ours, max_num_batched_tokens=64)
    assert served.attention_config.backend == AttentionBackendEnum.CPU_MLA and served.cache_config.block_size == 16
    assert served.scheduler_config.enable_chunked_prefill and served.scheduler_config.max_num_batched_tokens == 64
    assert served.cache_config.enable_prefix_caching  # vLLM's default, kept: blocks of int4_joint can be shared
    whole = config(ours, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert not whole.scheduler_config.enable_chunked_prefill and whole.scheduler_config.max_num_batched_tokens >= 256
    assert not whole.cache_config.enable_prefix_caching
    assert not config(pooled).cache_config.enable_prefix_caching  # the pools find a sequence by its first block
    other = config(plain)
    assert other.attention_config.backend is None and other.cache_config.block_size != 16
    with pytest.raises(ValueError, match=r"backend=AMX_MLA: .* is an exported checkpoint .* allowed: CPU_MLA"):
        config(ours, attention_config={"backend": AttentionBackendEnum.AMX_MLA})


def _recording_platform(name: str) -> type:
    """A platform class whose own config check records the models it was asked about (the plugin wraps it)."""
    def check_and_update_config(cls, vllm_config):
        cls.checked.append(vllm_config.model_config.model)

    return type(name, (), {"checked": [], "check_and_update_config": classmethod(check_and_update_config)})


def test_an_exported_checkpoint_is_refused_where_no_backend_serves_its_format(tmp_path):
    """On a platform where no backend of ours serves the format (neither vLLM's CPU one nor a CUDA GPU's: ROCm's,
    XPU's), vLLM's own backends would store their own cache and the checkpoint's format would do nothing: the
    plugin's wrapped config check refuses such a folder by name, with the way to serve the weights alone, and leaves
    any other model to the platform's own check."""
    from types import SimpleNamespace

    from mla_quant.serving import CACHE_FILE
    from mla_quant.serving.vllm_plugin import serve_exported

    GpuPlatform = _recording_platform("GpuPlatform")
    serve_exported(GpuPlatform, "GpuPlatform")
    serve_exported(GpuPlatform, "GpuPlatform")  # once per process
    (tmp_path / CACHE_FILE).write_text("{}")
    with pytest.raises(ValueError, match=rf"is an exported checkpoint \({CACHE_FILE}\): its cache format is served "
                                         rf"on vLLM's CPU platform and on CUDA GPUs only, and on GpuPlatform .* "
                                         rf"allowed: vLLM's CPU build, a CUDA GPU, or the folder without {CACHE_FILE}"):
        GpuPlatform.check_and_update_config(SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path))))
    GpuPlatform.check_and_update_config(SimpleNamespace(model_config=SimpleNamespace(model="deepseek-ai/x")))
    assert GpuPlatform.checked == ["deepseek-ai/x"]


def test_an_exported_checkpoint_gets_the_triton_backend_on_a_cuda_gpu(tmp_path, monkeypatch):
    """On a CUDA GPU the plugin registers `LatentTritonMLABackend` as vLLM's CUSTOM backend and asks for it for a
    folder holding the cache description (another backend asked for one is refused by name); prefix caching is kept
    where sequences can share the format's blocks, turned off where a protected region's pool finds a sequence by
    its first block; vLLM's compile pass fusing RoPE with the MLA cache write (vLLM's own layout) is turned off.
    vLLM's own check of the backend (as CUDA's platform runs it) accepts the toy's latent width (112, outside vLLM's
    MLA head sizes) and DeepSeek's in bf16 and fp16 on sm_80 and sm_90, and refuses float32 and blocks that are not
    a multiple of 16, as vLLM's Triton MLA does."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends import registry

    from mla_quant.serving import CACHE_FILE
    from mla_quant.serving.vllm_plugin import SERVED_ON, serve_exported

    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", dict(registry._ATTN_OVERRIDES))
    registry.register_backend(registry.AttentionBackendEnum.CUSTOM,
                              "mla_quant.serving.vllm_backend.LatentTritonMLABackend")
    backend = registry.AttentionBackendEnum[SERVED_ON["cuda"]].get_class()
    assert backend is vllm_backend.LatentTritonMLABackend and backend.get_name() == "CUSTOM"
    assert backend.get_impl_cls() is vllm_backend.LatentTritonMLAImpl

    def reasons(head_size=112, dtype=torch.bfloat16, block_size=16, capability=(9, 0)):
        return backend.validate_configuration(head_size=head_size, dtype=dtype, kv_cache_dtype="auto",
                                              block_size=block_size, use_mla=True, has_sink=False, use_sparse=False,
                                              use_mm_prefix=False, use_per_head_quant_scales=False,
                                              device_capability=DeviceCapability(*capability), attn_type="decoder")

    for case in ({}, {"head_size": 576}, {"dtype": torch.float16}, {"capability": (8, 0)}, {"block_size": 64}):
        assert reasons(**case) == [], case
    assert reasons(dtype=torch.float32) and reasons(block_size=8)

    CudaPlatform = _recording_platform("CudaPlatform")
    serve_exported(CudaPlatform, "cuda")
    folders = {}
    for name, overrides in (("ours", []), ("pooled", ["quant.protected.n_sink=2", "quant.protected.recent=8"])):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        quant = compose(["model=toy_mla", "quant=int4_joint", *ENGINE, *overrides]).quant
        (folders[name] / CACHE_FILE).write_text(json.dumps({"quant": OmegaConf.to_container(quant, resolve=True),
                                                            "cache": {"format": "int4_joint", "d_c": 96, "d_r": 16}}))

    def config(model, backend=None):
        made = SimpleNamespace(model_config=SimpleNamespace(model=str(model)),
                               attention_config=SimpleNamespace(backend=backend),
                               scheduler_config=SimpleNamespace(enable_chunked_prefill=True,
                                                                max_num_batched_tokens=2048),
                               cache_config=SimpleNamespace(enable_prefix_caching=True),
                               compilation_config=SimpleNamespace(pass_config=SimpleNamespace(
                                   fuse_rope_kvcache_cat_mla=True)))
        CudaPlatform.check_and_update_config(made)
        return made

    ours, pooled = config(folders["ours"]), config(folders["pooled"])
    assert ours.attention_config.backend == registry.AttentionBackendEnum.CUSTOM
    assert ours.cache_config.enable_prefix_caching and ours.scheduler_config.enable_chunked_prefill
    assert not pooled.cache_config.enable_prefix_caching
    assert not ours.compilation_config.pass_config.fuse_rope_kvcache_cat_mla  # it would write vLLM's own layout
    other = config("deepseek-ai/x")  # any other model: the platform's own check alone
    assert other.attention_config.backend is None and other.compilation_config.pass_config.fuse_rope_kvcache_cat_mla
    assert CudaPlatform.checked == [str(folders["ours"]), str(folders["pooled"]), "deepseek-ai/x"]
    with pytest.raises(ValueError, match=r"backend=TRITON_MLA: .* is an exported checkpoint .* the CUSTOM backend "
                                         r"serves on this platform; allowed: CUSTOM"):
        config(folders["ours"], registry.AttentionBackendEnum.TRITON_MLA)


@pytest.mark.parametrize("option, overrides, named", [
    ("int4_joint", ["quant.mode=simulated"], "quant.mode=simulated"),
    ("int2_joint", ["quant.content.quantizer=lloyd"], "lloyd reads a codebook fitted per layer, and .* holds none"),
])
def test_what_the_engine_cannot_store_is_refused_by_name(option, overrides, named):
    from omegaconf import OmegaConf

    cfg = compose(["model=toy_mla", f"quant={option}", *ENGINE, *overrides])
    description = {"quant": OmegaConf.to_container(cfg.quant, resolve=True),
                   "cache": {"format": option, "d_c": 96, "d_r": 16}}
    with pytest.raises(ValueError, match=named):
        vllm_backend.served_format(description)


@pytest.mark.slow
def test_serve_the_toy_in_vllm(tmp_path):
    """python run.py experiment=serve on the toy: the exported int4_joint checkpoint, with INT2 content in layer 1 and
    INT2 RoPE in layer 3 (each engine layer finds its own format), in vLLM's engine gives the framework's greedy
    tokens on all 16 prompts (as does the unquantized cache); each layer's pages in the cache vLLM allocated take
    its own format's bytes, and at one KV memory budget vLLM holds the blocks those bytes say (about 7x the
    unquantized cache's), so the trace that preempts the unquantized cache runs without preemption, as the scheduler
    simulation predicts (also at both levels of a concurrency sweep); a toy suite scored through the engine (lm-eval's
    vLLM model) scores as through the framework."""
    done = run_cli("experiment=serve", "logger=none", f"hydra.run.dir={tmp_path}",
                   "+quant.layers=[null,{content:{bits:2}},null,{rope:{bits:2}}]",  # a format per layer
                   "eval=toy", "eval.tasks=[toy_gsm8k]", "eval.limit=8", "task.concurrency=[4,32]", "task.repeats=1")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "record.json").read_text())["metrics"]
    for cache in ("unquantized", "int4_joint"):
        assert metrics[f"serve/{cache}/tokens_equal"] == 16
    assert metrics["serve/unquantized/page_bytes_per_block"] == 16 * (96 + 16) * 4
    assert metrics["serve/unquantized/blocks"] == 1048576 // (4 * 16 * 448)  # the budget over the toy's 4 layers
    fmt = vllm_backend.served_format(json.loads((tmp_path / "checkpoint" / "mla_quant_cache.json").read_text()))
    pages = [vllm_backend.EnginePages(f, 16, torch.float32).token_bytes * 16 for f in fmt.layers]
    assert pages[0] == pages[2] == 16 * 72 > pages[1] and pages[0] > pages[3]  # INT2 content / RoPE: fewer bytes
    allocated = json.loads((tmp_path / "engine" / "int4_joint_result.json").read_text())["layer_page_bytes"]
    assert [allocated[f"model.layers.{i}.self_attn.attn"] for i in range(4)] == pages  # each layer its own
    assert metrics["serve/int4_joint/blocks"] == 1048576 // sum(pages)
    assert metrics["serve/unquantized/preemptions"] > 0 and metrics["serve/int4_joint/preemptions"] == 0
    for cache in ("unquantized", "int4_joint"):
        assert metrics[f"serve/{cache}/simulated_preemptions"] == metrics[f"serve/{cache}/preemptions"]
        for n in (4, 32):  # the concurrency sweep, engine against simulation
            assert (metrics[f"serve/{cache}/sweep/{n}/simulated_preemptions"]
                    == metrics[f"serve/{cache}/sweep/{n}/preemptions"]), (cache, n)
    assert metrics["serve/unquantized/sweep/32/preemptions"] > 0 == metrics["serve/int4_joint/sweep/32/preemptions"]
    engine_layers = json.loads((tmp_path / "engine" / "int4_joint_result.json").read_text())["layer_formats"]
    exported = json.loads((tmp_path / "checkpoint" / "mla_quant_cache.json").read_text())["cache"]["layers"]
    assert [engine_layers[f"model.layers.{i}.self_attn.attn"] for i in range(4)] == exported  # each layer its own
    framework, engine = (metrics[f"serve/suites/toy_gsm8k/exact_match/{who}"] for who in ("framework", "engine"))
    assert framework == engine and framework > 0.5


@pytest.mark.slow
def test_serve_the_toy_with_a_protected_region(tmp_path):
    """experiment=serve with 2 sinks and the 8 latest tokens of each sequence kept in float32 beside vLLM's blocks
    (INT2 on both paths): the engine gives the framework's greedy tokens (its cache protecting the same tokens) on all
    16 prompts, where the framework's without the protected region differ on some; no sequence loses its slot, and
    the pools' bytes (16 sequences x 10 tokens x 112 values x 4 B, in each of 4 layers) come out of the blocks'
    budget."""
    from mla_quant.models.absorbed import cache_kwargs, quantized_cache
    from mla_quant.toy.model import load_toy_model

    done = run_cli("experiment=serve", "logger=none", f"hydra.run.dir={tmp_path}", "quant=int2_joint",
                   "quant.protected.n_sink=2", "quant.protected.recent=8", "task.max_num_seqs=16",
                   "task.concurrency=null", "task.repeats=1")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "record.json").read_text())["metrics"]
    pool = 4 * 16 * 10 * 112 * 4
    assert metrics["serve/int2_joint/tokens_equal"] == 16 and metrics["serve/int2_joint/protected_misses"] == 0
    assert metrics["serve/int2_joint/protected_pool_bytes"] == pool
    assert metrics["serve/int2_joint/blocks"] == (1048576 - pool) // 4 // (16 * 44)
    prompts = json.loads((tmp_path / "engine" / "framework_tokens.json").read_text())["prompts"]
    engine = json.loads((tmp_path / "engine" / "int2_joint_result.json").read_text())["tokens"]
    toy, quant = load_toy_model(), compose(["model=toy_mla", "quant=int2_joint", *ENGINE]).quant
    with torch.no_grad():
        unprotected = [toy.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                    **cache_kwargs(quantized_cache(toy, quant)))[0, len(p):].tolist() for p in prompts]
    assert sum(a != b for a, b in zip(unprotected, engine)) > 0


@pytest.mark.slow
def test_serve_kivi_with_its_pending_tokens_in_the_pool(tmp_path):
    """experiment=serve with KIVI's INT2 content (per channel over 32-token blocks), 2 sinks and the 8 latest tokens:
    the engine stores a block when it fills and reads the tokens after the last whole block from the pool, and gives
    the framework's greedy tokens on all 16 prompts; the pools (16 sequences x (2 + 8 + 32) tokens x 112 values x
    4 B, in each of 4 layers) come out of the blocks' budget, and the trace the unquantized cache preempts runs
    without preemption."""
    done = run_cli("experiment=serve", "logger=none", f"hydra.run.dir={tmp_path}", "quant=kivi_int2",
                   "quant.protected.n_sink=2", "quant.protected.recent=8", "task.max_num_seqs=16",
                   "task.kv_budget_bytes=2097152", "task.concurrency=null", "task.repeats=1")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "record.json").read_text())["metrics"]
    pool = 4 * 16 * (2 + 8 + 32) * 112 * 4
    assert metrics["serve/kivi_int2/tokens_equal"] == 16 and metrics["serve/kivi_int2/protected_misses"] == 0
    assert metrics["serve/kivi_int2/protected_pool_bytes"] == pool
    assert metrics["serve/kivi_int2/blocks"] == (2097152 - pool) // 4 // (16 * 48)  # 36 B of content + 12 of RoPE
    assert metrics["serve/unquantized/preemptions"] > 0 == metrics["serve/kivi_int2/preemptions"]


@pytest.mark.slow
def test_serve_the_toy_with_chunked_prefill_and_prefix_caching(tmp_path):
    """experiment=serve with INT2 on both paths, 16 prompts after the same 40 tokens, chunked prefill (24 tokens per
    engine step, one sequence at a time) and vLLM's prefix caching: each prompt after the first finds the leading
    whole blocks an earlier prompt computed cached (the tokens vLLM counts are those `engine_cuts` says, in both runs
    of the trace: its cache emptied before each), computes the rest in chunks from there, and reads everything before
    a chunk as the cache stored it. The engine gives the framework's greedy tokens on all 16 prompts when the
    framework cuts each prompt's computing where the engine did, where prefilling whole, or in chunks without the
    cached blocks, gives other tokens on some."""
    from types import SimpleNamespace

    from mla_quant.models.absorbed import quantized_cache
    from mla_quant.stages.serve import engine_cuts, framework_tokens
    from mla_quant.toy.model import load_toy_model

    done = run_cli("experiment=serve", "logger=none", f"hydra.run.dir={tmp_path}", "quant=int2_joint",
                   "task.prefix_tokens=40", "task.prefix_caching=true", "task.prefill_chunk=24", "task.max_num_seqs=1",
                   "task.concurrency=null", "task.repeats=2")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "record.json").read_text())["metrics"]
    assert metrics["serve/int2_joint/tokens_equal"] == metrics["serve/unquantized/tokens_equal"] == 16
    result = json.loads((tmp_path / "engine" / "int2_joint_result.json").read_text())
    assert result["scheduler"]["chunked_prefill"] and result["scheduler"]["max_num_batched_tokens"] == 24
    assert result["scheduler"]["prefix_caching"]
    assert (tmp_path / "serve.md").read_text().count("| chunks of 24 |") == 2  # both caches' rows say so
    prompts = json.loads((tmp_path / "engine" / "framework_tokens.json").read_text())["prompts"]
    hits = [cuts[-1] if cuts else 0 for cuts in engine_cuts(prompts, None, 16)]  # the blocks found cached
    assert hits[0] == 0 and min(hits[1:]) >= 32
    assert [run["prefix_hit_tokens"] for run in result["runs"]] == [sum(hits)] * 2
    assert metrics["serve/int2_joint/simulated_prefix_hit_tokens"] == sum(hits)  # the scheduler alone finds them too
    toy = load_toy_model()
    quant = compose(["model=toy_mla", "quant=int2_joint", *ENGINE]).quant
    prep = SimpleNamespace(model=toy, new_cache=lambda: quantized_cache(toy, quant))
    for cuts in (None, engine_cuts(prompts, 24, None)):  # whole; in chunks, as if nothing were cached
        other = framework_tokens(prep, prompts, 24, cuts=cuts)
        assert sum(o != e[:len(o)] for o, e in zip(other, result["tokens"])) > 0


GPU_CLASSES_IN_THE_CPU_ENGINE = """
import json, sys
from mla_quant.serving import vllm_backend, vllm_plugin, vllm_run

def backend(name):  # the backend class vLLM's CPU platform gets for CPU_MLA in this run
    def register():
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        register_backend(AttentionBackendEnum.CPU_MLA, f"mla_quant.serving.vllm_backend.{name}")
        vllm_plugin.serve_exported(type(current_platform), "cpu")
    return register

seen = set()
decode = vllm_backend.LatentFormatImpl.forward_mqa
def forward_mqa(self, *args):
    seen.add(type(self).__name__)
    return decode(self, *args)
vllm_backend.LatentFormatImpl.forward_mqa = forward_mqa
request = json.loads(sys.argv[1])
out = {}
for name in ("LatentTritonMLABackend", "LatentMLABackend"):
    from vllm.v1.attention import selector
    selector._cached_get_attn_backend.cache_clear()  # vLLM keeps the class it resolved for the first engine
    vllm_plugin.register = backend(name)
    seen.clear()
    result = vllm_run.run_engine(request)
    out[name] = {"tokens": result["tokens"], "impls": sorted(seen), "blocks": result["num_blocks"],
                 "misses": result["protected"]["misses"]}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_the_gpu_backend_classes_serve_in_vllms_engine(tmp_path):
    """The GPU backend's classes (`LatentTritonMLABackend`: vLLM's Triton MLA metadata builder, with the format's
    metadata, one token per decode row and no CUDA graphs, and `LatentTritonMLAImpl` over vLLM's Triton MLA
    implementation) in vLLM's real engine, here its CPU one (CPU_MLA pointed at them; decode by the C++ kernel, as
    the CPU's device type asks): an exported int2_joint checkpoint with 2 sinks and an 8-token window, prompts cut
    into chunks of 16 tokens, generate the same tokens and hold the same blocks as the CPU backend's classes, with
    no pool slot lost."""
    import subprocess
    import sys

    done = run_cli("experiment=export", "quant=int2_joint", "quant.mode=serving", "quant.protected.n_sink=2",
                   "quant.protected.recent=8", "logger=none", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in (30, 47, 18, 61, 35, 52)]
    request = {"model": str(tmp_path / "checkpoint"), "prompts": prompts, "max_tokens": 12, "dtype": "bfloat16",
               "kv_cache_memory_bytes": 1 << 20, "max_model_len": 256, "max_num_seqs": 1, "prefill_chunk": 16}
    run = subprocess.run([sys.executable, "-c", GPU_CLASSES_IN_THE_CPU_ENGINE, json.dumps(request)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))[6:])
    gpu, cpu = out["LatentTritonMLABackend"], out["LatentMLABackend"]
    assert gpu["impls"] == ["LatentTritonMLAImpl"] and cpu["impls"] == ["LatentMLAImpl"]
    assert gpu["tokens"] == cpu["tokens"] and all(len(t) == 12 for t in gpu["tokens"])
    assert gpu["blocks"] == cpu["blocks"] and gpu["misses"] == cpu["misses"] == 0


def test_a_format_per_layer_round_trips_through_the_description():
    """An exported format per layer (quant.layers; lloyd codebooks per layer) is rebuilt by the engine as it was:
    each layer's paths and levels."""
    import dataclasses
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from mla_quant.stages.export import cache_description

    layers = "+quant.layers=[null,{content:{bits:2,quantizer:lloyd}},null,{rope:{bits:2}}]"
    cfg = compose(["model=toy_mla", "quant=int4_joint", *ENGINE, layers])
    fmt = cache_format(cfg.quant, 96, 16, num_layers=4, rope_layout="interleaved")
    book = (-0.4, 1.1, 2.0, 3.3)  # a codebook as the preparation step fits it (2^bits levels in code units)
    fitted = dataclasses.replace(fmt.layers[1], content=dataclasses.replace(fmt.layers[1].content, levels=book))
    fmt = dataclasses.replace(fmt, layers=(fmt.layers[0], fitted, *fmt.layers[2:]))
    description = {"quant": OmegaConf.to_container(cfg.quant, resolve=True),
                   "cache": {**cache_description(SimpleNamespace(fmt=fmt)), "rope_layout": "interleaved"}}
    served = vllm_backend.served_format(json.loads(json.dumps(description)))
    assert served.layers == fmt.layers and served.layers[1].content.levels == book
    assert [vllm_backend.EnginePages(f, 16, torch.float32).token_bytes for f in served.layers] == [72, 48, 72, 68]


@pytest.mark.parametrize("overrides, named", [
    (["quant=int4_joint", "quant.mode=simulated"], "quant.mode=simulated"),
    (["quant=kivi_int4"], "(n_sink 0, recent 0, token_block 32) takes 14680064 bytes for task.max_num_seqs=256"),
    (["quant=int4_joint", "quant.protected.n_sink=20", "quant.protected.recent=8"],
     r"n_sink=20 sinks do not fit a sequence's first block (block_size 16)"),
    (["quant=int4_joint", "quant.protected.n_sink=2", "quant.protected.recent=8", "task.prefix_caching=true",
      "task.max_num_seqs=1"], "task.prefix_caching=true: quant=int4_joint: sequences cannot share its blocks: its "
                              "protected pool")])
def test_serve_refuses_before_exporting(tmp_path, overrides, named):
    """A format the engine cannot store, pools that fill the KV budget (KIVI's pending tokens: 32 per sequence, for
    vLLM's default 256 sequences), sinks wider than the engine's block (vLLM's CPU MLA: 16 tokens), or prefix caching
    where sequences cannot share the format's blocks, fail experiment=serve at once, before any preparation or
    export."""
    done = run_cli("experiment=serve", *overrides, "logger=none", f"hydra.run.dir={tmp_path}")
    assert done.returncode != 0 and named in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize("cuda", [False, True], ids=["other", "cuda"])
def test_serve_refuses_where_no_backend_serves_the_format_before_exporting(tmp_path, monkeypatch, cuda):
    """experiment=serve where vLLM's platform is neither its CPU one nor a CUDA GPU's (no backend serves the format
    there) fails at once, naming the platform and what is allowed, before any export; on a CUDA GPU, float32
    activations (the CPU's default here) are refused by name: vLLM's GPU MLA attention runs in bf16 or fp16."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: cuda)
    done = run_cli("experiment=serve", "logger=none", f"hydra.run.dir={tmp_path}")
    assert done.returncode != 0, done.stderr[-2000:]
    named = ("task.dtype='float32' on a CUDA GPU: vLLM's GPU MLA attention runs in ['bfloat16', 'float16']" if cuda
             else f"its cache format is served on vLLM's CPU platform and on CUDA GPUs only, and on "
                  f"{type(current_platform).__name__}")
    assert named in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize("override, named", [
    ("task.dtype=fp32", "task.dtype='fp32'"), ("task.concurrency=4", "task.concurrency=4"),
    ("task.repeats=0", "task.repeats"),
    ("task.prefill_chunk=64", r"task.prefill_chunk=64: an engine step's tokens .* allowed: an integer >= 256"),
    ("task.prefill_chunk=16 task.max_num_seqs=4", r"task.prefill_chunk=16 with task.max_num_seqs=4 and "
                                                  r"task.require_equal=true: .* allowed: task.max_num_seqs=1, or "
                                                  r"task.require_equal=false"),
    ("task.prefix_caching=true task.max_num_seqs=4", r"task.prefix_caching=true with task.max_num_seqs=4 and "
                                                     r"task.require_equal=true: .* allowed: task.max_num_seqs=1"),
    ("task.prefix_caching=yes", "task.prefix_caching='yes'; allowed: true or false"),
    ("task.prefix_tokens=0", "task.prefix_tokens=0")])
def test_serve_settings_refused_by_name(override, named):
    from mla_quant.stages.serve import check_task

    with pytest.raises(ValueError, match=named):
        check_task(compose(["experiment=serve", *override.split()]).task)
    if "max_num_seqs=4" in override:  # each prompt computed alone, or agreement reported only
        for fix in ("task.max_num_seqs=1", "task.require_equal=false"):
            check_task(compose(["experiment=serve", *override.split(), fix]).task)
