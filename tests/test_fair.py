"""Fair comparisons: the bytes a cache holds are the sum of its parts, measured from its tensors; each needle's region
(stored quantized or protected) is where the cache really keeps it; a needle placement puts the asked needle where a
cache quantizes it; the development split shares no key with the test split."""

import pytest
import torch
from omegaconf import OmegaConf

from mla_quant.cache.bytes import HeldBytes, load_quant_option
from mla_quant.cache.factory import layer_factory
from mla_quant.cache import LatentCache
from mla_quant.cache.peers import PeerLatentCacheLayer
from mla_quant.eval.needles import check_placement, needle_region
from mla_quant.eval.task_files import token_offsets, write_task_files
from mla_quant.quant.formats import cache_format
from mla_quant.tasks import arithmetic, code, niah
from mla_quant.tasks.split import bucket, in_split, split_of
from mla_quant.toy.model import load_toy_tokenizer

D_C, D_R = 96, 16  # the toy's latent dims
GROUPS = {"wide": 32, "narrow": 32}


def fmt_of(option: str, **settings):
    cfg = load_quant_option(option, groups=GROUPS)
    return cache_format(OmegaConf.merge(cfg, settings), D_C, D_R)


def latents(b: int, t: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, D_C, generator=g).to(dtype), torch.randn(b, t, D_R, generator=g).to(dtype)


def filled(option_or_fmt, lengths=(300, 17), steps: int = 5, dtype=torch.float32, **settings):
    """A two-layer cache of the format with a left-padded batch: a prefill, then `steps` one-token steps."""
    fmt = fmt_of(option_or_fmt, **settings) if isinstance(option_or_fmt, str) else option_or_fmt
    cache = LatentCache(2, layer_factory(fmt))
    t = max(lengths)
    valid = torch.zeros(len(lengths), t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, t - n:] = True
    c, r = latents(len(lengths), t, dtype)
    for layer in cache.layers:
        layer.append(c, r, valid)
    for s in range(steps):
        c, r = latents(len(lengths), 1, dtype, seed=s + 1)
        for layer in cache.layers:
            layer.append(c, r)
    return cache


@pytest.mark.parametrize("option,settings", [
    ("bf16", {}), ("int4_joint", {}), ("int2_content_int4_rope", {}), ("kivi_int2", {}), ("fp8_ds_mla", {}),
    ("fp8_flat", {}), ("int2_joint", {"protected": {"n_sink": 0, "recent": 0}}),
])
def test_bytes_held_are_the_sum_of_the_parts(option, settings):
    """byte_parts as held sums to the measured nbytes; at the run's element size it is the same; at BF16 it equals
    what the same cache filled with bfloat16 latents holds."""
    cache = filled(option, **settings)
    parts = cache.byte_parts()
    assert sum(parts.values()) == pytest.approx(cache.nbytes())
    assert cache.byte_parts(act_bytes=4) == pytest.approx(parts)
    bf16 = filled(option, dtype=torch.bfloat16, **settings)
    assert cache.byte_parts(act_bytes=2) == pytest.approx(bf16.byte_parts())
    fmt = fmt_of(option, **settings)
    if fmt.quantized and fmt.recent:  # both regions are there: full precision holds sinks + window (+ pending)
        assert parts["quantized"] > 0 and parts["full precision"] > 0
    if not fmt.quantized:
        assert parts["quantized"] == 0 and parts["full precision"] == pytest.approx(cache.nbytes())
    held = HeldBytes()
    held.add(cache)
    held.add(bf16)
    m = held.metrics("cache")
    tokens = 2 * 2 * (300 + 17 + 2 * 5)
    assert m["cache/token_layers"] == tokens
    assert m["cache/bf16_B_per_token_per_layer"] == pytest.approx(2 * sum(bf16.byte_parts().values()) / tokens)
    assert m["cache/held_B_per_token_per_layer"] == pytest.approx((cache.nbytes() + bf16.nbytes()) / tokens)


@pytest.mark.parametrize("option", ["hf_hqq_int2", "hf_quanto_int4"])
def test_peer_bytes_by_part(option, quanto_unpacks_in_python):
    """A peer's parts: codes with scales and zeros, and the unquantized residual; their sum is its nbytes, and at
    BF16 the float32 scales and zeros count 2 bytes each (the nominal bytes per quantized token)."""
    fmt = cache_format(load_quant_option(option), D_C, D_R)
    layer = PeerLatentCacheLayer(fmt)
    c, r = latents(1, 256)
    layer.append(c, r)
    for s in range(10):
        layer.append(*latents(1, 1, seed=s + 1))
    parts = layer.byte_parts()
    assert sum(parts.values()) == pytest.approx(layer.nbytes(), abs=1)
    assert parts["full precision"] == 10 * (D_C + D_R) * 4
    at_bf16 = layer.byte_parts(act_bytes=2)
    assert at_bf16["quantized"] == pytest.approx(256 * fmt.bytes_per_token(2))
    assert at_bf16["full precision"] == 10 * (D_C + D_R) * 2


def _exact_positions(fmt, n: int) -> list[bool]:
    """Which positions of an n-token prompt appended at once read back exactly from a cache layer of `fmt`."""
    layer = layer_factory(fmt)()
    c, r = latents(1, n)
    layer.append(c, r)
    rc, rr = layer.read()
    return [bool(torch.equal(rc[0, i], c[0, i]) and torch.equal(rr[0, i], r[0, i])) for i in range(n)]


@pytest.mark.parametrize("option,settings,n", [
    ("int4_joint", {}, 300), ("int4_joint", {}, 100), ("kivi_int2", {}, 300), ("int2_joint", {"protected":
     {"n_sink": 0, "recent": 0}}, 200), ("int2_content_int4_rope", {"protected": {"n_sink": 7, "recent": 33}}, 250),
])
def test_quantized_positions_are_where_the_cache_quantizes(option, settings, n):
    """The format's quantized positions of a prompt are exactly the positions that do not read back bit for bit."""
    fmt = fmt_of(option, **settings)
    start, end = fmt.quantized_positions(n)
    exact = _exact_positions(fmt, n)
    assert exact == [not (start <= i < end) for i in range(n)]
    assert end > start or n <= fmt.n_sink + fmt.recent


def test_quantized_positions_of_a_layered_format_and_a_peer():
    base = load_quant_option("int4_joint", groups=GROUPS)
    fmt = cache_format(OmegaConf.merge(base, {"layers": [None, {"content": {"bits": 2}}]}), D_C, D_R)
    assert type(fmt).__name__ == "CacheSpec" and fmt.quantized_positions(300) == (4, 172)
    peer = cache_format(load_quant_option("hf_hqq_int2"), D_C, D_R)
    assert peer.quantized_positions(300) == (0, 300)  # transformers quantizes the whole prompt


def test_needle_region_names_where_the_value_sits():
    fmt = fmt_of("int4_joint")  # sinks 4, recent 128
    doc = {"length": 400, "needle_tokens": [[100, 107]]}
    assert needle_region(doc, fmt) == "quantized"
    assert needle_region({**doc, "needle_tokens": [[300, 307]]}, fmt) == "protected"
    assert needle_region({**doc, "needle_tokens": [[270, 275]]}, fmt) == "straddling"  # 272 = 400 - 128
    assert needle_region(doc, fmt_of("bf16")) == needle_region(doc, None) == "unquantized"
    assert needle_region({"length": 10}, fmt) is None  # not a needle task


@pytest.fixture(scope="module")
def tok():
    return load_toy_tokenizer()


def test_needle_tokens_are_the_value_in_the_model_tokens(tok):
    """needle_tokens picks the asked value's tokens out of the prompt as the model tokenizes it, and `length` is the
    prompt's token count."""
    count = lambda s: len(tok(s).input_ids)  # noqa: E731
    for variant in niah.VARIANTS:
        for doc in niah.test_set(variant, [512], 4, seed=5, count_tokens=count, token_offsets=token_offsets(tok)):
            ids = tok(doc["prompt"]).input_ids
            assert len(ids) == doc["length"]
            for (a, b), (_, value) in zip(doc["needle_tokens"], doc["needles"]):
                assert tok.decode(ids[a:b]).strip() == value


def test_needle_placement_keeps_the_asked_needle_out_of_the_window(tok):
    count = lambda s: len(tok(s).input_ids)  # noqa: E731
    offsets = token_offsets(tok)
    anywhere = niah.test_set("single_2", [256, 512], 16, seed=1234, count_tokens=count, token_offsets=offsets)
    placed = niah.test_set("single_2", [256, 512], 16, seed=1234, count_tokens=count, token_offsets=offsets,
                           outside=(4, 128))
    fmt = fmt_of("int4_joint")
    assert {needle_region(d, fmt) for d in placed} == {"quantized"}
    assert "protected" in {needle_region(d, fmt) for d in anywhere}  # RULER's uniform depth reaches the window
    with pytest.raises(ValueError, match="no placement of the asked needle in a 256-token single_3 prompt"):
        niah.test_set("single_3", [256], 2, seed=1, count_tokens=count, token_offsets=offsets, outside=(4, 128))
    check_placement([4, 128], fmt)
    check_placement(None, fmt_of("int4_joint", protected={"recent": 512}))
    check_placement([0, 0], fmt_of("bf16"))
    with pytest.raises(ValueError, match=r"needle_outside=\[4,128\].*protects 4 sinks and 256 recent"):
        check_placement([4, 128], fmt_of("int4_joint", protected={"recent": 256}))


def test_dev_split_shares_no_key_with_test(tmp_path, tok):
    """Item by item: every dev example's key (needle keys and values, problem keys) is a dev key, none is a test key,
    and the test sets are what they were (their own bucket, their own seeds)."""
    assert {split_of(k) for k in ("a", "b")} <= {"train", "test"}
    keys = [f"k{i}" for i in range(4000)]
    assert not [k for k in keys if in_split(k, "dev") and in_split(k, "test")]
    assert all(in_split(k, "train") for k in keys if in_split(k, "dev"))  # carved from the training buckets
    assert 300 < sum(in_split(k, "dev") for k in keys) < 700  # about 1 in 8
    for variant in niah.VARIANTS:
        dev = niah.test_set(variant, [1024], 12, seed=7, split="dev")
        test = niah.test_set(variant, [1024], 12, seed=7)
        dev_keys = {x for d in dev for n in d["needles"] for x in ("niah-key:" + n[0], "niah-value:" + n[1])}
        test_keys = {x for d in test for n in d["needles"] for x in ("niah-key:" + n[0], "niah-value:" + n[1])}
        assert all(bucket(k) == 1 for k in dev_keys) and all(bucket(k) == 0 for k in test_keys)
        assert not dev_keys & test_keys
    dev_arith = arithmetic.test_set(50, 1, "dev")
    assert all(in_split("arith:" + p["key"], "dev") for p in dev_arith)
    assert not {p["key"] for p in dev_arith} & {p["key"] for p in arithmetic.test_set(50, 1)}
    dev_code = code.test_set(20, 1, "dev")
    assert all(in_split(p["key"], "dev") for p in dev_code)
    assert not {p["key"] for p in dev_code} & {p["key"] for p in code.test_set(20, 1)}
    with pytest.raises(ValueError, match="split='train'"):
        arithmetic.test_set(5, 1, "train")
    # the task files of each split hold that split's documents only
    folder = write_task_files(tmp_path / "dev", tok, split="dev", niah_lengths=[512], niah_per_length=2,
                              tasks=["toy_niah_single_2", "toy_gsm8k"], arithmetic_n=5)
    assert (folder / "toy_niah_single_2.jsonl").is_file() and not (folder / "toy_niah_single_1.jsonl").exists()


@pytest.mark.parametrize("quant", [["quant=int4_joint"], ["quant=mixed", "quant.budget=int2_joint"]])
def test_a_placement_narrower_than_the_protected_region_is_refused_before_any_weight(quant):
    from conftest import compose

    from mla_quant.stages import evaluate

    cfg = compose(["experiment=evaluate", *quant, "quant.protected.recent=256", "eval.data.needle_outside=[4,128]"])
    with pytest.raises(ValueError, match=r"quant=(int4_joint|mixed) protects 4 sinks and 256 recent"):
        evaluate.check(cfg, data=False)
    evaluate.check(compose(["experiment=evaluate", *quant, "eval.data.needle_outside=[4,256]",
                            "quant.protected.recent=256"]), data=False)
