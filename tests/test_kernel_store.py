"""The Triton store path (quantize-and-append into the paged pool) against the PyTorch encoder: the same bytes, for
every int format the kernel reads, odd lengths and several sequences (Triton's CPU interpreter here, set in
conftest.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mla_quant.cache import cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.paged import PagedStore
from mla_quant.kernels.quant_store import quantize_append
from mla_quant.quant.formats import PathFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

FORMATS = [  # (bits, group_size, symmetric, scale_dtype), d = 96 (the toy's d_c)
    (bits, group, sym, sdt)
    for bits in (2, 4, 8)
    for group, sym, sdt in ((32, False, "fp16"), (None, False, "bf16"), (48, True, "fp32"), (16, False, "pow2"),
                            (12, True, "pow2"), (96, True, "bf16"))
]


def latents(n: int, d: int, seed: int) -> torch.Tensor:
    """Gaussian rows with outliers, plus rows that hit the encoder's corner cases: a constant group, all zeros,
    exact ties of the rounding, a range that is an exact power of two times 2^b - 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[:, 5] *= 20
    x[0] = 0.0
    x[1, : d // 2] = 1.25
    if n > 2:
        x[2] = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0, 7.5, 15.0])[torch.arange(d) % 7]
    if n > 3:
        x[3] = torch.arange(d, dtype=torch.float32) % 4 * 0.25
    return x.to(DEVICE)


def stores(fmt: PathFormat, d: int, lengths: list[int], block_size: int, seed: int):
    """Two paged stores filled with the same tokens: the PyTorch encoder + append, and the Triton store kernel."""
    b = len(lengths)
    rows = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths)).to(DEVICE)
    x = latents(int(sum(lengths)), d, seed)
    torch_store, kernel_store = PagedStore(b, block_size, DEVICE), PagedStore(b, block_size, DEVICE)
    torch_store.append(rows, {f"content/{part}": t for part, t in fmt.encode(x).items()})
    pos = kernel_store.reserve(rows)
    kernel_store.declare({f"content/{part}": (t.shape[1:], t.dtype) for part, t in fmt.encode(x[:1]).items()})
    pools = {part: kernel_store.part(f"content/{part}") for part in ("codes", "scales", "zeros")
             if f"content/{part}" in kernel_store.part_names()}  # views of one page per block
    quantize_append(x, rows, pos, kernel_store.block_table(), block_size, pools["codes"], pools["scales"],
                    pools.get("zeros"), bits=fmt.bits, group=fmt.group_size, symmetric=fmt.symmetric,
                    scale_dtype=fmt.scale_dtype)
    return torch_store, kernel_store


@pytest.mark.parametrize("bits, group, symmetric, scale_dtype", FORMATS)
def test_store_kernel_writes_the_encoders_bytes(bits, group, symmetric, scale_dtype):
    fmt = PathFormat("int", bits, group, symmetric, scale_dtype)
    ref, got = stores(fmt, 96, [7, 0, 13], block_size=4, seed=bits)
    assert torch.equal(ref.lengths, got.lengths) and ref.tables == got.tables
    dense_ref, _ = ref.dense()
    dense_got, _ = got.dense()
    for part in dense_ref:
        a, b = dense_ref[part], dense_got[part]
        for row, n in enumerate(ref.lengths.tolist()):
            diff = int((a[row, :n].view(torch.uint8) != b[row, :n].view(torch.uint8)).sum())
            assert diff == 0, f"{fmt.describe()}: {part} of sequence {row}: {diff} bytes differ from the encoder"


@pytest.mark.parametrize("d, bits, group", [(16, 4, None), (16, 2, None), (50, 4, 25), (64, 8, 1)])
def test_store_kernel_odd_dims(d, bits, group):
    """Dimensions that leave padding fields in the last words, a group per value, the RoPE key's size."""
    fmt = PathFormat("int", bits, group, False, "fp16")
    ref, got = stores(fmt, d, [3, 5], block_size=2, seed=d)
    for part, t in ref.dense()[0].items():
        assert torch.equal(t.view(torch.uint8), got.dense()[0][part].view(torch.uint8)), f"d={d} bits={bits}: {part}"


@pytest.mark.parametrize("option, override", [
    ("int4_joint", {"content": {"group_size": 32}}),
    ("int2_content_int4_rope", {"content": {"group_size": 16, "scale_dtype": "pow2"}}),
    ("int4_content", {"content": {"bits": 8, "group_size": 96, "symmetric": True, "scale_dtype": "bf16"}}),
])
def test_triton_layer_stores_what_the_torch_layer_stores(option, override, monkeypatch):
    """A layer with quant.backend=triton writes its quantized tokens through the store kernel; padding, odd
    prefill lengths and single-token appends leave exactly the torch layer's stored tensors."""
    from mla_quant.cache.kernel import KernelLatentCacheLayer
    from mla_quant.kernels import quant_store

    calls = []
    monkeypatch.setattr(quant_store, "quantize_append", lambda *a, **k: calls.append(1) or quantize_append(*a, **k))

    base = OmegaConf.merge(load_quant_option(option), override, {"protected": {"n_sink": 2, "recent": 5},
                                                                 "block_size": 8})
    layers = {b: cache_layer_factory(OmegaConf.merge(base, {"backend": b}), 96, 16)() for b in ("torch", "triton")}
    assert isinstance(layers["triton"], KernelLatentCacheLayer)
    g = torch.Generator().manual_seed(1)
    c, r = torch.randn(3, 40, 96, generator=g).to(DEVICE), torch.randn(3, 40, 16, generator=g).to(DEVICE)
    valid = torch.ones(3, 40, dtype=torch.bool, device=DEVICE)
    valid[1, :9], valid[2, :27] = False, False
    for layer in layers.values():
        layer.append(c[:, :23], r[:, :23], valid[:, :23])
        for t in range(23, 40):
            layer.append(c[:, t : t + 1], r[:, t : t + 1], valid[:, t : t + 1])
    assert layers["triton"].n_quantized == 40 - 2 - 5
    assert len(calls) >= 2 * 2, "the triton layer did not store through the kernel"  # prefill, then steady steps
    for path in ("content", "rope"):
        want, got = layers["torch"].stored_parts(path), layers["triton"].stored_parts(path)
        lengths = layers["torch"].store.lengths.tolist()
        for part in want:
            for row, n in enumerate(lengths):
                assert torch.equal(want[part][row, :n], got[part][row, :n]), f"{option} {path}.{part} row {row}"


def test_store_kernel_refuses_bad_pools():
    fmt = PathFormat("int", 4, 32, False, "fp16")
    x = latents(3, 96, 0)
    store = PagedStore(1, 4, DEVICE)
    pos = store.reserve(torch.zeros(3, dtype=torch.long, device=DEVICE))
    store.declare({f"content/{part}": (t.shape[1:], t.dtype) for part, t in fmt.encode(x[:1]).items()})
    pools = {name.split("/")[1]: view for name, view in store.pool.items()}
    args = (x, torch.zeros(3, dtype=torch.long, device=DEVICE), pos, store.block_table(), 4)
    kw = dict(bits=4, group=32, symmetric=False, scale_dtype="fp16")
    with pytest.raises(ValueError, match=r"scales must be a contiguous \(num_blocks, block_size, 3\) torch.float16"):
        quantize_append(*args, pools["codes"], pools["scales"].float(), pools["zeros"], **kw)
    with pytest.raises(ValueError, match=r"zeros must be"):
        quantize_append(*args, pools["codes"], pools["scales"], None, **kw)
    with pytest.raises(ValueError, match=r"bits=3 \(the store kernel packs \[2, 4, 8\]\)"):
        quantize_append(*args, pools["codes"], pools["scales"], pools["zeros"], **{**kw, "bits": 3})
    with pytest.raises(ValueError, match=r"scale_dtype='fp8'; allowed"):
        quantize_append(*args, pools["codes"], pools["scales"], pools["zeros"], **{**kw, "scale_dtype": "fp8"})
