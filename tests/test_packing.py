"""Bit packing: round trips for every width and odd shapes, the documented byte layout, and bad inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.kernels.layout import WORD_BITS, WordLayout
from mla_quant.quant.packing import PACK_BITS, pack, pack_reference, packed_dim, unpack


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(PACK_BITS),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    n=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(bits, lead, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert packed.shape == (*lead, packed_dim(n, bits)), f"bits={bits} n={n}: shape {tuple(packed.shape)}"
    assert packed_dim(n, bits) == -(-n * bits // 8)
    back = unpack(packed, bits, n)
    mismatches = int((back != codes).sum())
    assert mismatches == 0, f"bits={bits} shape={tuple(codes.shape)}: {mismatches} codes changed"
    assert torch.equal(packed, pack_reference(codes, bits)), f"bits={bits} n={n}: pack differs from the bit-stream spec"


def test_layout_low_bits_first():
    assert pack(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]  # low nibble first
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00_11_10_01]
    # INT3: 8 values in 3 bytes, the 24-bit little-endian word sum v_i << 3i
    vals = [1, 2, 3, 4, 5, 6, 7, 0]
    word = sum(v << (3 * i) for i, v in enumerate(vals))
    assert pack(torch.tensor(vals, dtype=torch.uint8), 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert pack(torch.tensor([200, 7], dtype=torch.uint8), 8).tolist() == [200, 7]


def test_packed_sizes_at_real_dims():
    assert [packed_dim(512, b) for b in (2, 3, 4, 8)] == [128, 192, 256, 512]
    assert [packed_dim(64, b) for b in (2, 3, 4, 8)] == [16, 24, 32, 64]
    assert packed_dim(5, 3) == 2 and packed_dim(9, 3) == 4  # ceil(n * 3 / 8)


def test_bad_inputs_name_the_value():
    codes = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits=5"):
        pack(codes, 5)
    with pytest.raises(ValueError, match="code 16 does not fit in bits=4"):
        pack(torch.tensor([3, 16], dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="int32"):
        pack(codes.int(), 4)
    with pytest.raises(ValueError, match="n=9"):
        unpack(torch.zeros(4, dtype=torch.uint8), 4, 9)


# ------------------------------------------------------------------------------------------- the kernels' word layout
@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(WORD_BITS), lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
       d=st.integers(1, 130), seed=st.integers(0, 2**31 - 1))
def test_word_layout_round_trip_and_field_rule(bits, lead, d, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, d), generator=gen, dtype=torch.uint8)
    layout = WordLayout(bits, d)
    words = layout.pack(codes)
    assert words.dtype == torch.int32 and words.shape == (*lead, layout.words)
    assert layout.row_bytes == 4 * -(-d * bits // 32)
    assert torch.equal(layout.unpack(words), codes)
    assert torch.equal(layout.unpack_float(words), codes.float())  # from the words' bytes
    if lead:  # a strided slice of a batch of words
        assert torch.equal(layout.unpack_float(words[..., ::2, :]), codes[..., ::2, :].float())
    # the documented rule, one field at a time: field k of word j holds channel k W + j (0 past d)
    w = words.reshape(-1, layout.words).long() & 0xFFFFFFFF
    flat = codes.reshape(-1, d).long()
    for k in range(layout.per_word):
        for j in range(layout.words):
            ch = k * layout.words + j
            want = flat[:, ch] if ch < d else torch.zeros_like(flat[:, 0])
            assert torch.equal((w[:, j] >> (k * bits)) & (2**bits - 1), want), f"bits={bits} d={d} field {k} word {j}"


def test_word_layout_bytes_equal_the_bit_stream_where_words_fill():
    for bits in WORD_BITS:
        for d in (16, 64, 96, 512):
            assert WordLayout(bits, d).row_bytes == packed_dim(d, bits), (bits, d)


def test_word_layout_refuses_bad_input():
    with pytest.raises(ValueError, match=r"bits=3; allowed: \[2, 4, 8\]"):
        WordLayout(3, 64)
    with pytest.raises(ValueError, match=r"codes \(\.\.\., 64\) expected"):
        WordLayout(4, 64).pack(torch.zeros(2, 63, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"int32 \(\.\.\., 8\) expected"):
        WordLayout(4, 64).unpack(torch.zeros(2, 8, dtype=torch.uint8))
