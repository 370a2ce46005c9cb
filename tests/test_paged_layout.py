"""The paged store's page layout (one page per block and path: codes | scales | zeros, PageLayout) and the kernels
reading and writing those block-strided views (Triton's CPU interpreter here, set in conftest.py). Small shapes:
the interpreter is slow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from mla_quant.cache import cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.paged import PagedStore
from mla_quant.kernels.latent_decode import PagedPath, Segment, latent_decode
from mla_quant.kernels.torch_decode import latent_decode_reference
from mla_quant.kernels.layout import PageLayout, WordLayout
from mla_quant.kernels.quant_store import quantize_append
from mla_quant.quant.formats import PathFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_a_blocks_scales_and_zeros_follow_its_codes_in_one_page():
    store = PagedStore(2, 8, DEVICE)
    words = WordLayout(4, 96).words  # 12 int32 words per token
    store.declare({"content/zeros": ((3,), torch.float16), "content/codes": ((words,), torch.int32),
                   "content/scales": ((3,), torch.float16), "rope/values": ((16,), torch.bfloat16)})
    store.reserve(torch.tensor([0] * 11 + [1] * 3, device=DEVICE))  # blocks 0, 1 (sequence 0), 2 (sequence 1)
    codes, scales, zeros = (store.part(f"content/{p}") for p in ("codes", "scales", "zeros"))
    page = 8 * words * 4 + 8 * 3 * 2 + 8 * 3 * 2  # 384 + 48 + 48 bytes: no alignment pad
    assert store.layouts["content"].page_bytes == page and store.pages["content"].shape == (3, page)
    assert scales.data_ptr() == codes.data_ptr() + 8 * words * 4  # the scales right after the block's codes
    assert zeros.data_ptr() == scales.data_ptr() + 8 * 3 * 2  # then its zeros
    assert codes[1].data_ptr() == codes.data_ptr() + page and scales[2].data_ptr() == scales.data_ptr() + 2 * page
    assert codes.untyped_storage().data_ptr() == zeros.untyped_storage().data_ptr()
    assert (codes.stride(), scales.stride()) == ((page // 4, words, 1), (page // 2, 3, 1))
    assert store.part("rope/values").is_contiguous()  # a path of one part: its page is just that part
    assert store.token_bytes() == words * 4 + 3 * 2 + 3 * 2 + 16 * 2
    assert store.held_bytes() == 3 * 8 * store.token_bytes() and store.used_bytes() == 14 * store.token_bytes()


def test_pages_grow_and_keep_their_layout():
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    fmt = PathFormat("int", 4, 16, False, "pow2")
    store = PagedStore(2, 8, DEVICE)
    rows = torch.tensor([0] * 12 + [1] * 8, device=DEVICE)
    parts = {f"content/{k}": v for k, v in fmt.encode(x).items()}
    store.append(rows[:5], {k: v[:5] for k, v in parts.items()})
    store.append(rows[5:], {k: v[5:] for k, v in parts.items()})  # grows the pool: blocks of both sequences
    got = store.gather(rows, torch.cat([torch.arange(12), torch.arange(8)]).to(DEVICE), list(parts))
    assert all(torch.equal(got[k], parts[k]) for k in parts)
    assert [name for name, _, _ in store.layouts["content"].parts] == ["content/codes", "content/scales",
                                                                      "content/zeros"]
    moved = store.rebuilt(lambda t: t.flip(0))
    assert moved.layouts == store.layouts
    assert torch.equal(moved.dense()[0]["content/scales"][0, :8], store.dense()[0]["content/scales"][1, :8])
    with pytest.raises(ValueError, match=r"path 'content' already holds blocks"):
        store.declare({"content/extra": ((1,), torch.float32)})
    with pytest.raises(ValueError, match=r"PagedStore part content/scales: declared as"):
        store.part("content/scales", (2,), torch.float16)


def test_tokens_written_ahead_read_as_the_general_append_once_counted_in():
    """reserve_ahead + write + advance (a steady decode's tokens written before they are counted in) stores what
    append with rows 0..B-1 stores, one token per sequence a step, across block boundaries and after a truncation; the
    tokens written ahead stay out of every read until counted in."""
    g = torch.Generator().manual_seed(1)
    fmt = PathFormat("int", 4, 16, False, "fp16")
    stores = [PagedStore(3, 4, DEVICE), PagedStore(3, 4, DEVICE)]
    first = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2], device=DEVICE)  # uneven lengths: 3, 1, 5
    x = torch.randn(9, 32, generator=g).to(DEVICE)
    for store in stores:
        store.append(first, {f"content/{k}": v for k, v in fmt.encode(x).items()})
    ahead = []
    for step in range(11):
        if step == 6:
            for store in stores:
                store.truncate(torch.tensor([2, 9, 4], device=DEVICE))
            ahead = []  # what was written ahead is dropped with the truncation
        if not ahead:
            k = 3 if step < 6 else 5
            tokens = fmt.encode(torch.randn(3 * k, 32, generator=g).to(DEVICE))
            rows, pos = stores[0].reserve_ahead(k)
            stores[0].write(rows, pos, {f"content/{n}": v for n, v in tokens.items()})
            ahead = [{f"content/{n}": v.view(3, k, *v.shape[1:])[:, j] for n, v in tokens.items()} for j in range(k)]
            before = stores[0].dense()
            assert torch.equal(before[1], stores[1].dense()[1])  # not counted in
        stores[0].advance()
        stores[1].append(torch.arange(3, device=DEVICE), ahead.pop(0))
        (a, la), (b, lb) = stores[0].dense(), stores[1].dense()
        assert torch.equal(la, lb) and stores[0]._host_lengths == la.tolist()
        for k in a:
            ok = torch.arange(a[k].shape[1], device=DEVICE)[None, :] < la[:, None]
            assert torch.equal(a[k][ok], b[k][ok]), (step, k)
    with pytest.raises(RuntimeError, match="no token reserved"):
        PagedStore(1, 4, DEVICE).advance()


def test_alignment_pads_are_held_not_used():
    layout = PageLayout.of(4, {"codes": ((3,), torch.int32), "scales": ((3,), torch.int8)})
    assert (layout.offset("scales"), layout.page_bytes, layout.token_bytes) == (48, 64, 15)  # 12 scale bytes + 4
    store = PagedStore(1, 4, DEVICE)
    store.append(torch.zeros(5, dtype=torch.long, device=DEVICE),
                 {"content/codes": torch.ones(5, 3, dtype=torch.int32, device=DEVICE),
                  "content/scales": torch.ones(5, 3, dtype=torch.int8, device=DEVICE)})
    assert (store.used_bytes(), store.held_bytes()) == (5 * 15, 2 * 64)


@pytest.mark.parametrize("option, override", [
    ("int4_joint", {"content": {"group_size": 32}}),
    ("int2_content_int4_rope", {"content": {"group_size": 16, "scale_dtype": "pow2"}}),
])
def test_layer_bytes_are_whole_pages(option, override):
    """A layer's store: one page pool per path, held bytes = blocks x block size x the format's bytes per token."""
    quant = OmegaConf.merge(load_quant_option(option), override, {"protected": {"n_sink": 2, "recent": 4},
                                                                 "block_size": 16})
    layer = cache_layer_factory(quant, 64, 16)()
    layer.append(torch.randn(2, 45, 64), torch.randn(2, 45, 16))
    store, fmt = layer.store, layer.fmt
    per_token = fmt.content.bytes_per_token(64) + fmt.rope.bytes_per_token(16)
    assert sorted(store.pages) == ["content", "rope"]
    assert store.token_bytes() == per_token and store.held_bytes() == store.num_blocks * 16 * per_token
    assert store.used_bytes() == int(store.lengths.sum()) * per_token


# ------------------------------------------------------------------------------------------ kernels on pages
PAGE_FORMATS = {  # content format, rope format (d_c = 32, d_r = 16)
    "int2 asym fp16 + int4 asym": (PathFormat("int", 2, 16, False, "fp16"), PathFormat("int", 4, 8, False, "fp16")),
    "int4 sym pow2 + int8 sym": (PathFormat("int", 4, 8, True, "pow2"), PathFormat("int", 8, None, True, "fp32")),
    "int8 asym bf16 + bf16": (PathFormat("int", 8, 32, False, "bf16"), PathFormat()),
    "int4 asym pow2 + int2 sym": (PathFormat("int", 4, 16, False, "pow2"), PathFormat("int", 2, 16, True, "bf16")),
}


def paged_segment(formats, lengths, block_size=8, seed=0, kernel_store=False):
    """A segment of page-strided views: tokens encoded by the PyTorch encoder (or quantized by the store kernel)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEVICE)
    store, paths = PagedStore(len(lengths), block_size, DEVICE), {}
    pos = store.reserve(rows)
    for name, fmt, d in (("content", formats[0], 32), ("rope", formats[1], 16)):
        x = torch.randn(rows.numel(), d, generator=g).to(DEVICE)
        if kernel_store and fmt.quantized:
            store.declare({f"{name}/{k}": (v.shape[1:], v.dtype) for k, v in fmt.encode(x[:1]).items()})
            quantize_append(x, rows, pos, store.block_table(), block_size, store.part(f"{name}/codes"),
                            store.part(f"{name}/scales"), None if fmt.symmetric else store.part(f"{name}/zeros"),
                            bits=fmt.bits, group=fmt.group_size, symmetric=fmt.symmetric, scale_dtype=fmt.scale_dtype)
        else:
            store.write(rows, pos, {f"{name}/{k}": v for k, v in fmt.encode(x).items()})
    for name, fmt, d in (("content", formats[0], 32), ("rope", formats[1], 16)):
        views = {k.split("/")[1]: v for k, v in store.pool.items() if k.startswith(name + "/")}
        spec = fmt.kernel_spec(d)
        paths[name] = PagedPath(views["values"] if spec["bits"] == 0 else views["codes"], views.get("scales"),
                                views.get("zeros"), spec["bits"], spec["group"], spec["symmetric"], spec["pow2"])
    return Segment(paths["content"], paths["rope"], store.block_table(), store.lengths.clone()), store


@pytest.mark.parametrize("name", list(PAGE_FORMATS))
def test_kernel_reads_page_strided_pools(name):
    seg, store = paged_segment(PAGE_FORMATS[name], [37, 0, 20], kernel_store=name.startswith("int4 asym"))
    if PAGE_FORMATS[name][0].quantized:
        assert not seg.content.data.is_contiguous() and not seg.content.scales.is_contiguous()  # views of pages
    g = torch.Generator().manual_seed(1)
    q, qr = torch.randn(3, 2, 32, generator=g).to(DEVICE), torch.randn(3, 2, 16, generator=g).to(DEVICE)
    out = latent_decode(q, qr, 0.2, [seg], block_n=16, split_tokens=16)
    torch.testing.assert_close(out, latent_decode_reference(q, qr, 0.2, [seg]), rtol=1e-4, atol=1e-5)
    copied = replace(seg, content=replace(seg.content, **{k: None if t is None else t.contiguous() for k, t in
                                                          (("data", seg.content.data), ("scales", seg.content.scales),
                                                           ("zeros", seg.content.zeros))}))
    torch.testing.assert_close(out, latent_decode(q, qr, 0.2, [copied], block_n=16, split_tokens=16), rtol=0, atol=0)


def test_rows_must_be_contiguous_the_block_stride_is_free():
    seg, _ = paged_segment(PAGE_FORMATS["int2 asym fp16 + int4 asym"], [20, 9])
    q, qr = torch.randn(2, 2, 32, device=DEVICE), torch.randn(2, 2, 16, device=DEVICE)
    scales = seg.content.scales
    strided_rows = torch.cat([scales, scales], -1)[..., ::2]  # same shape, values 2 apart
    with pytest.raises(ValueError, match=r"segments\[0\]\.content\.scales must be contiguous in its \(block_size, "
                                         r"\*\) dims \(any block stride"):
        latent_decode(q, qr, 0.2, [replace(seg, content=replace(seg.content, scales=strided_rows))])
    with pytest.raises(ValueError, match=r"segments\[0\]\.rope\.zeros must be contiguous in its"):
        latent_decode(q, qr, 0.2, [replace(seg, rope=replace(seg.rope, zeros=seg.rope.zeros.transpose(1, 2)
                                                              .contiguous().transpose(1, 2)))])
    x = torch.randn(1, 32, device=DEVICE)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"quantize_append: scales must be a contiguous \(num_blocks, block_size, 2\)"
                                         r" torch.float16 pool, or a view of one with any block stride"):
        quantize_append(x, one, one, seg.block_table, 8, seg.content.data, strided_rows, seg.content.zeros, bits=2,
                        group=16, symmetric=False, scale_dtype="fp16")
