"""A cache format per layer (quant.layers) and quant=mixed's allocation: each layer stores exactly what its own
format stores (logits and bytes equal to a cache assembled from the named uniform options), the knapsack is optimal
(checked by enumeration), the allocation is measured, stored with its provenance and reused, and bad settings are
refused by name before any weight is read."""

import itertools
import json
import random

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose
from mla_quant.cache import LatentCache, cache_layer_factory
from mla_quant.cache.bytes import byte_table, load_quant_option
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.prepare import model_dims, prepare_model, validate
from mla_quant.quant.formats import CacheSpec, cache_bytes_per_token, cache_format, fake_quantizer
from mla_quant.quant.mixed import knapsack
from mla_quant.sensitivity.allocation import (_weights, load_allocation, mixed_spec, sensitivity_from_record,
                                              solve)
from mla_quant.toy.model import load_toy_model

D_C, D_R, LAYERS = 96, 16, 4  # the toy's latent dims and cache layers
GROUPS = {"wide": 32, "narrow": 32}  # the toy's quant_group_size


@pytest.fixture(scope="module")
def toy():
    return load_toy_model()


def option(name: str, **merge):
    return OmegaConf.merge(load_quant_option(name, groups=GROUPS), merge)


# ---------------------------------------------------------------------------------------------- the knapsack
def test_knapsack_is_optimal_by_enumeration():
    rng = random.Random(0)
    for case in range(60):
        groups = [[(rng.choice([0.5, 1.25, 2.0, 3.0, 4.75, 8.0]) + rng.random() * (case % 2), rng.random())
                   for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 5))]
        lo, hi = sum(min(c for c, _ in g) for g in groups), sum(max(c for c, _ in g) for g in groups)
        budget = lo + (hi - lo) * rng.random()
        feasible = [(sum(g[k][1] for g, k in zip(groups, ks)), ks) for ks in
                    itertools.product(*[range(len(g)) for g in groups])
                    if sum(g[k][0] for g, k in zip(groups, ks)) <= budget + 1e-12]
        best = min(e for e, _ in feasible)
        picks, cost, err = knapsack(groups, budget)
        assert err == pytest.approx(best, abs=1e-12), case
        assert cost <= budget + 1e-12 and cost == pytest.approx(sum(g[k][0] for g, k in zip(groups, picks)))
        assert err == pytest.approx(sum(g[k][1] for g, k in zip(groups, picks)))


def test_knapsack_refuses_an_unreachable_budget():
    with pytest.raises(ValueError, match="no allocation fits the budget 1; the cheapest costs 3"):
        knapsack([[(1.0, 0.5), (2.0, 0.1)], [(2.0, 0.3)]], 1.0)


# ---------------------------------------------------------------------------------------------- quant.layers
LAYERED = [None, {"content": {"bits": 2}, "rope": {"bits": 2}}, {"rope": {"format": "bf16", "bits": 16}},
           {"content": {"bits": 8}, "rope": {"bits": 8}}]


def named_layers():
    """The same per-layer formats from the uniform options (on the toy they differ from int4_joint in bits only)."""
    return [option("int4_joint"), option("int2_joint"), option("int4_joint", rope={"format": "bf16", "bits": 16}),
            option("int8_joint")]


def test_layers_store_what_each_layer_format_stores(toy):
    """int4_joint with quant.layers: the logits over a prefill and decode steps, and every layer's bytes, equal a
    cache assembled from the named options layer by layer; and the layers do change what is stored."""
    cfg = option("int4_joint", layers=LAYERED, protected={"recent": 16})
    fmt = cache_format(cfg, D_C, D_R, num_layers=LAYERS)
    assert isinstance(fmt, CacheSpec) and [f.content.bits for f in fmt.layers] == [4, 2, 4, 8]
    assert [f.rope.quantized for f in fmt.layers] == [True, True, False, True]
    ours = quantized_cache(toy, cfg)
    theirs = LatentCache(LAYERS, [cache_layer_factory(OmegaConf.merge(q, {"protected": {"recent": 16}}), D_C, D_R)
                                  for q in named_layers()])
    uniform = quantized_cache(toy, option("int4_joint", protected={"recent": 16}))
    ids = torch.randint(3, 1024, (1, 200), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(3, 1024, (6, 1, 1), generator=torch.Generator().manual_seed(1))
    moved = 0.0
    with torch.no_grad():
        for x in [ids, *steps]:
            a = toy(x, use_cache=True, **cache_kwargs(ours)).logits
            b = toy(x, use_cache=True, **cache_kwargs(theirs)).logits
            c = toy(x, use_cache=True, **cache_kwargs(uniform)).logits
            assert torch.equal(a, b)
            moved = max(moved, float((a - c).abs().max()))
    assert moved > 1e-3
    tokens = 206
    for i, (layer, f) in enumerate(zip(ours.layers, fmt.layers)):
        assert layer.nbytes() == theirs.layers[i].nbytes(), i
        # the formula of the layer's own format (the toy runs in float32: unquantized values take 4 bytes)
        assert layer.nbytes() == round(cache_bytes_per_token(f, D_C, D_R, tokens, act_bytes=4) * tokens), i
    assert len({layer.nbytes() for layer in ours.layers}) == 4


def test_layers_decode_the_same_through_the_kernel(toy):
    """Per-layer formats with quant.backend=triton: each layer's decode steps through the kernel, the same logits as
    the PyTorch read path. 32 tokens, 22 of them quantized past the protected 10 (the interpreter runs the store
    kernel once per token)."""
    ids = torch.randint(3, 1024, (1, 32), generator=torch.Generator().manual_seed(2))
    layers = [None, {"content": {"bits": 2}, "rope": {"bits": 2}}, {"rope": {"format": "bf16", "bits": 16}},
              {"content": {"bits": 8}, "rope": {"bits": [8, 4, 2, 16]}}]  # a width per group of RoPE pairs
    logits = {}
    for backend in ("torch", "triton"):
        cache = quantized_cache(toy, option("int4_joint", layers=layers, backend=backend,
                                            protected={"n_sink": 2, "recent": 8}))
        with torch.no_grad():
            toy(ids, use_cache=True, **cache_kwargs(cache))
            logits[backend] = torch.stack([toy(ids[:, -1:], use_cache=True, **cache_kwargs(cache)).logits
                                           for _ in range(2)])
        assert cache.backends_run() == {"prefill": "torch", "decode": backend}
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers,match", [
    ([None] * 3, r"quant.layers has 3 entries; the model has 4 cache layers"),
    ([None, {"value": {}}, None, None], r"quant.layers\[1\]: unknown key\(s\) \['value'\]; allowed: \['content', 'rope'\]"),
    ([None, None, {"content": {"bits": 5}}, None], r"quant.layers\[2\]: quant.content.bits=5 is not a width"),
    ([None, None, None, {"content": {"group_size": 40}}], r"quant.layers\[3\]: quant.content.group_size=40 does not "
                                                           r"divide the path dimension 96"),
    ("int2", r"quant.layers='int2'; allowed: null or a list with one entry per cache layer"),
])
def test_bad_layers_are_refused_by_name(layers, match, toy):
    with pytest.raises(ValueError, match=match):
        quantized_cache(toy, option("int4_joint", layers=layers))


def test_layers_are_refused_where_one_format_is_read():
    cfg = compose(["experiment=sensitivity", "task.noise=quantizer", "quant=mixed"])
    from mla_quant.stages.sensitivity import noise_quantizers

    with pytest.raises(ValueError, match=r"quant=mixed sets formats per layer \(quant.budget\)"):
        noise_quantizers(cfg, {"content": D_C, "rope": D_R})
    with pytest.raises(ValueError, match=r"quant=mixed \(\['budget', 'choices', 'allocation'\]\) allocates bits"):
        byte_table(["mixed"], contexts=[1024])


# ---------------------------------------------------------------------------------------------- quant=mixed
def assert_holds_its_bytes(prep, tokens: int = 300):
    """A prompt through the prepared model's cache: each layer holds exactly its own format's bytes (float32 toy)."""
    cache = prep.new_cache()
    ids = torch.randint(3, 1024, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prep.model(ids, use_cache=True, **cache_kwargs(cache))
    for layer, f in zip(cache.layers, prep.fmt.layers):
        assert layer.nbytes() == round(cache_bytes_per_token(f, D_C, D_R, tokens, act_bytes=4) * tokens)


def spec_of(*overrides, dims=(D_C, D_R, LAYERS)):
    quant = OmegaConf.create(OmegaConf.to_container(compose(["quant=mixed", *overrides]).quant, resolve=True))
    return mixed_spec(quant, *dims, context=2048, groups=GROUPS)


def test_budget_of_a_named_option_is_its_bytes():
    spec = spec_of("quant.budget=int2_content_int4_rope")
    uniform = cache_format(option("int2_content_int4_rope"), D_C, D_R)
    assert spec.budget == uniform.content.bytes_per_token(D_C) + uniform.rope.bytes_per_token(D_R) == 48
    assert spec.budget_format == uniform  # what transforms are fitted for (transform.fit.format=auto)
    assert spec_of("quant.budget=44.5").budget == 44.5 and spec_of("quant.budget=44.5").budget_name is None
    assert spec_of("quant.budget=44.5").budget_format is None


def test_the_option_quantizer_applies_to_every_quantized_choice():
    """quant.<path>.quantizer on quant=mixed: every integer choice quantizes with it, the unquantized one stores
    values (its quantizer is not an integer range's)."""
    spec = spec_of("quant.content.quantizer=hqq", "quant.rope.quantizer=clip")
    assert {spec.path_format("content", k).quantizer for k in range(len(spec.choices["content"]))} == {"hqq"}
    rope = [spec.path_format("rope", k) for k in range(len(spec.choices["rope"]))]
    assert [(f.format, f.quantizer) for f in rope] == [("int", "clip")] * 4 + [("bf16", "rtn")]


@pytest.mark.parametrize("overrides,match", [
    (["quant.budget=20"], r"quant.budget=20 \(20 B/token/layer\) is below the cheapest allocation of quant.choices "
                          r"\(36: every layer at its fewest bits\)"),
    (["quant.budget=300"], r"quant.budget=300 \(300 B/token/layer\) is above BF16's 224"),
    (["quant.budget=int9"], r"unknown quant option 'int9'"),
    (["quant.budget=hf_hqq_int2"], r"quant.budget='hf_hqq_int2': allowed a uniform option"),
    (["quant.budget=-3"], r"quant.budget=-3; allowed: bytes per token per layer"),
    (["quant.choices.content=[]"], r"quant.choices.content=\[\]; allowed: a non-empty list"),
    (["quant.choices.rope=[2,5]"], r"quant.choices.rope\[1\].bits=5 is not a width of format=int"),
    (["quant.choices.rope=[2,2]"], r"quant.choices.rope\[1\]=2 repeats an earlier choice"),
    (["quant.choices.content=[{group_size: 16}]"], r"quant.choices.content\[0\]: choice .* a mapping needs bits"),
    (["quant.allocation.by=greedy"], r"quant.allocation.by='greedy'; allowed: \['sensitivity', 'cache_nmse', "
                                     r"'random'\]"),
    (["+quant.allocation.steps=3"], r"quant.allocation: unknown key\(s\) \['steps'\]"),
    (["quant.allocation.sensitivity=/no/such/run"], r"quant.allocation.sensitivity='/no/such/run': no such file"),
    (["+quant.content.bits=4"], r"quant.content.bits: quant=mixed stores every path as format int at the widths of "
                                r"quant.choices.content"),
    (["quant.protected.recent=3000"], r"covers the whole context of 2048 tokens"),
    (["quant.backend=triton"], r"quant.choices.content\[2\]=.*'bits': 3.*quant.backend=triton cannot read it"),
    (["quant.content.quantizer=lloyd"], r"quant.choices.content\[5\].quantizer=lloyd fits non-uniform levels at bits "
                                        r"\[2, 3, 4\]; got bits=8"),  # the choice it cannot take is named
    # settings the run would not read, changed from their defaults
    (["quant.allocation.seed=3"], r"quant.allocation.seed=3 would do nothing: quant.allocation.seed draws the weights "
                                  r"of by=random; this run has by=sensitivity; drop it"),
    (["quant.allocation.by=cache_nmse", "quant.allocation.nmse=0.02"],
     r"quant.allocation.nmse=0.02 would do nothing: .* by=cache_nmse measures no sensitivity"),
    (["quant.allocation.sensitivity=tests", "quant.allocation.seeds=3"],
     r"quant.allocation.seeds=3 would do nothing: .*; the weights are read from 'tests'"),
    (["quant.allocation.file=pyproject.toml", "quant.allocation.by=random"],
     r"quant.allocation.by='random' would do nothing: quant.allocation.file='pyproject.toml' is used as is"),
])
def test_bad_mixed_settings_are_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        spec_of(*overrides)


def test_mixed_needs_calibration_data_and_a_named_fit_format():
    dims = model_dims(compose([]).model)
    cfg = compose(["quant=mixed"])
    cfg.calib = None
    with pytest.raises(ValueError, match="quant='mixed' measures each width's cache NMSE on calibration latents"):
        validate(cfg, dims)
    with pytest.raises(ValueError, match="stores content as format=codebook in every layer"):
        validate(compose(["quant=mixed", "transform=turboquant"]), dims)
    with pytest.raises(ValueError, match="name it: transform.fit.format=int2_content_int4_rope"):
        validate(compose(["quant=mixed", "quant.budget=44", "transform=quantmla"]), dims)
    validate(compose(["quant=mixed", "transform=quantmla"]), dims)  # fitted for the budget's own option


def test_random_and_cache_nmse_weights():
    a, b = _weights(spec_of("quant.allocation.by=random"), None, None, {})[0], \
        _weights(spec_of("quant.allocation.by=random", "quant.allocation.seed=1"), None, None, {})[0]
    assert a == _weights(spec_of("quant.allocation.by=random"), None, None, {})[0] and a != b
    assert set(a) == {(i, p, None) for i in range(LAYERS) for p in ("content", "rope")}
    assert all(0 < v < 1 for v in a.values())
    assert set(_weights(spec_of("quant.allocation.by=cache_nmse"), None, None, {})[0].values()) == {1.0}


def test_mixed_allocates_measures_stores_and_reuses(tmp_path):
    """The toy at int2_joint's bytes: the allocation is the knapsack's optimum over its own measured table, spends
    no more than the budget, stores and reuses itself, and the cache it builds holds exactly its formats' bytes."""
    overrides = ["quant=mixed", "quant.budget=int2_joint", f"quant.allocation.cache_dir={tmp_path}",
                 "quant.allocation.sequences=2", "quant.allocation.seeds=1", "calib.samples=8", "calib.seq_len=192"]
    prep = prepare_model(compose(overrides))
    m = prep.metrics()
    assert isinstance(prep.fmt, CacheSpec) and m["alloc/reused"] == 0 and m["alloc/budget_name"] == "int2_joint"
    assert m["alloc/bytes_per_token_per_layer"] <= m["alloc/budget"] == 44
    assert m["cache/bytes_per_token_per_layer"] == m["alloc/bytes_per_token_per_layer"]
    stored = json.loads(open(m["alloc/file"]).read())
    assert stored["provenance"]["config_sha256"] == stored["config_sha256"]  # the artifact store's provenance
    assert stored["identity"]["weights"] and stored["dims"] == {"d_c": D_C, "d_r": D_R, "layers": LAYERS}
    spec = spec_of("quant.budget=int2_joint", f"quant.allocation.cache_dir={tmp_path}")
    table = {(i, p, None, k): v for i, layer in enumerate(stored["nmse"]) for p, ks in layer.items()
             for k, v in enumerate(ks)}
    weights = {(i, p, None): w for i, layer in enumerate(stored["weights"]) for p, w in layer.items()}
    # the optimum by enumeration over every allocation of the toy's 4 layers x 2 paths
    per_layer = [[(spec.cost("content", kc) + spec.cost("rope", kr),
                   weights[i, "content", None] * table[i, "content", None, kc]
                   + weights[i, "rope", None] * table[i, "rope", None, kr])
                  for kc in range(len(spec.choices["content"])) for kr in range(len(spec.choices["rope"]))]
                 for i in range(LAYERS)]
    best = min(sum(e for _, e in combo) for combo in itertools.product(*per_layer)
               if sum(c for c, _ in combo) <= 44 * LAYERS)
    assert stored["predicted_error"] == pytest.approx(best, rel=1e-12)
    assert solve(spec, table, weights)[0] == stored["picks"]
    # the stored weights came from the toy's own injections: layers differ, RoPE amplified somewhere
    assert len({round(w, 9) for w in weights.values()}) == 2 * LAYERS
    assert_holds_its_bytes(prep)  # the cache built from it holds its formats' bytes
    # reused as stored
    again = prepare_model(compose(overrides))
    assert again.metrics()["alloc/reused"] == 1 and again.fmt == prep.fmt
    # a named file for other dims is refused
    other = spec_of(dims=(64, 16, LAYERS))
    with pytest.raises(ValueError, match=r"is for dims \{'d_c': 96, 'd_r': 16, 'layers': 4\}; this model has "
                                         r"\{'d_c': 64, 'd_r': 16, 'layers': 4\}"):
        load_allocation(type(tmp_path)(m["alloc/file"]), other)


def test_sensitivity_from_a_study_run(tmp_path):
    """The one-layer amplification read from a sensitivity run equals the study's own rows; other layer counts and
    a run without one-layer injections are refused."""
    from mla_quant.stages import sensitivity

    cfg = compose(["model=tiny_deepseek_v2", "experiment=sensitivity", "task.seeds=1", "task.sweep_nmse=[]",
                   "task.mechanism=false", "task.rope_pairs=false", "task.probe.num_sequences=2",
                   "task.probe.seq_len=32", "task.rope_groups=2"])
    sensitivity.run(cfg, tmp_path)
    layers = model_dims(cfg.model)["layers"]
    slopes = sensitivity_from_record(tmp_path, layers)
    import pandas as pd

    rows = pd.read_csv(tmp_path / "sensitivity_rows.csv")
    for (i, p, g), v in slopes.items():
        sel = rows[(rows.kind == "one_layer") & (rows.site == "logits") & (rows.layer == i) & (rows.path == p)]
        assert g is None and v == pytest.approx(float(sel.value.iloc[0]) / 0.01) and v > 0
    # per group of RoPE pairs (task.rope_groups=2): the study's rows of injections into each group's pairs alone
    grouped = sensitivity_from_record(tmp_path, layers, rope_groups=2)
    assert {k for k in grouped if k[1] == "rope"} == {(i, "rope", g) for i in range(layers) for g in range(2)}
    for (i, p, g), v in grouped.items():
        kind = "one_layer" if g is None else "one_layer_group"
        sel = rows[(rows.kind == kind) & (rows.site == "logits") & (rows.layer == i) & (rows.path == p) &
                   (rows.group == (-1 if g is None else g))]
        assert v == pytest.approx(float(sel.value.iloc[0]) / 0.01) and v > 0
    assert sum(grouped[i, "rope", g] for i in range(layers) for g in range(2)) > 0
    with pytest.raises(ValueError, match=r"no injections into 4 groups of RoPE pairs \(groups measured: \[2\]\); "
                                         r"run the study with task.rope_groups=4"):
        sensitivity_from_record(tmp_path, layers, rope_groups=4)
    prep = prepare_model(compose(["model=tiny_deepseek_v2", "quant=mixed", "quant.budget=int2_joint",
                                  "quant.allocation.rope_groups=2", f"quant.allocation.sensitivity={tmp_path}",
                                  f"quant.allocation.cache_dir={tmp_path / 'alloc'}", "calib.samples=2",
                                  "calib.seq_len=32", "quant.protected.recent=8"]))
    stored = json.loads(open(prep.metrics()["alloc/file"]).read())
    assert stored["weights_from"] == str(tmp_path)
    assert [layer["rope"] for layer in stored["weights"]] == [[grouped[i, "rope", g] for g in range(2)]
                                                              for i in range(layers)]
    with pytest.raises(ValueError, match=r"task.rope_groups=3; allowed: null \(off\) or a number of groups dividing"):
        sensitivity.validate(compose(["model=tiny_deepseek_v2", "experiment=sensitivity", "task.rope_groups=3"]))
    with pytest.raises(ValueError, match=rf"the model has {layers + 1} cache layers"):
        sensitivity_from_record(tmp_path / "sensitivity_rows.csv", layers + 1)
    rows[rows.kind != "one_layer"].to_csv(tmp_path / "none.csv", index=False)
    with pytest.raises(ValueError, match="no one-layer injections"):
        sensitivity_from_record(tmp_path / "none.csv", layers)


def test_export_describes_each_layer(tmp_path):
    """experiment=export with quant=mixed: the checkpoint's cache description lists every layer's formats and bytes
    and the allocation they came from."""
    from mla_quant.stages import export

    cfg = compose(["experiment=export", "quant=mixed", f"quant.allocation.cache_dir={tmp_path / 'alloc'}",
                   "quant.allocation.by=cache_nmse", "calib.samples=4", "calib.seq_len=128"])
    metrics = export.run(cfg, tmp_path).metrics
    desc = json.loads((tmp_path / "checkpoint" / "mla_quant_cache.json").read_text())["cache"]
    assert desc["format"] == "mixed" and len(desc["layers"]) == LAYERS and desc["allocation"] == metrics["alloc/file"]
    assert desc["layers"][0] == {"content": metrics["cache/layer0/content"], "rope": metrics["cache/layer0/rope"]}
    assert sum(desc["bytes_per_token_per_layer"]) / LAYERS == metrics["cache/bytes_per_token_per_layer"] <= 48


# ---------------------------------------------------------------------------------------------- bits per RoPE pair group
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_pairs_store_each_group_of_pairs_at_its_width(layout):
    """format=pairs: group g of the RoPE pairs (a pair's two channels together, in the model's layout) is one
    integer group at its own width; with one width everywhere it equals int at groups of those channels."""
    from mla_quant.quant.formats import PathFormat, pair_channels
    from mla_quant.quant.quantizers import fake_quantize
    from mla_quant.quant.rope import rope_pair

    x = torch.randn(7, 11, 64, generator=torch.Generator().manual_seed(0))
    fmt = cache_format(option("int4_joint", rope={"bits": [8, 4, 2, 16]}), D_C, 64, rope_layout=layout).rope
    assert fmt.format == "pairs" and fmt.pair_layout == layout and fmt.bits == (8, 4, 2, 16)
    groups = pair_channels(layout, 64, 4)
    assert sorted(c for g in groups for c in g) == list(range(64))
    assert set(rope_pair(layout, 64, 9)) <= set(groups[1])  # pair 9 of 32: the second group of 8 pairs
    got = fmt.decode(fmt.encode(x), 64, torch.float32)
    for bits, channels in zip(fmt.bits, groups):
        want = x[..., channels] if bits == 16 else fake_quantize(x[..., channels], bits, None, False, "fp16")
        assert torch.equal(got[..., channels], want)
    err = [(got - x)[..., ch].pow(2).mean() for ch in groups]
    assert err[3] == 0 < err[0] < err[1] < err[2]
    # bytes: per group its byte-stream codes + an fp16 scale and zero; the unquantized group at 2 B a value
    assert fmt.bytes_per_token(64) == (16 + 4) + (8 + 4) + (4 + 4) + 16 * 2
    # one width everywhere, interleaved (contiguous groups): the same values as int at groups of 16 channels
    if layout == "interleaved":
        same = cache_format(option("int4_joint", rope={"bits": [4, 4, 4, 4]}), D_C, 64, rope_layout=layout).rope
        plain = fake_quantizer(PathFormat.from_cfg({"format": "int", "bits": 4, "group_size": 16}), 64)
        assert torch.equal(same.decode(same.encode(x), 64, torch.float32), plain(x))


def test_pairs_in_a_model_cache_hold_their_bytes(toy):
    cfg = option("int4_joint", rope={"bits": [8, 2]}, protected={"recent": 16})
    cache = quantized_cache(toy, cfg)
    ids = torch.randint(3, 1024, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = toy(ids, use_cache=True, **cache_kwargs(cache)).logits
    assert torch.isfinite(logits).all()
    f = cache.layers[0].fmt
    assert f.rope.pair_layout == toy.mla_family.cached_rope_layout(toy.config)
    assert cache.layers[0].nbytes() == round(cache_bytes_per_token(f, D_C, D_R, 120, act_bytes=4) * 120)


@pytest.mark.parametrize("rope,match", [
    ({"bits": [8, 4, 2]}, r"quant.rope.bits has 3 groups of RoPE pairs; the path has 16 channels \(8 pairs\)"),
    ({"bits": [8, 5]}, r"quant.rope.bits=\[8, 5\]: format=pairs takes one width per group of RoPE pairs"),
    ({"bits": [8, 4], "group_size": 4}, r"quant.rope.group_size=4: with bits per group of pairs"),
])
def test_bad_pair_widths_are_refused(rope, match):
    with pytest.raises(ValueError, match=match):
        cache_format(option("int4_joint", rope=rope), D_C, D_R)


def test_pair_widths_refused_where_they_cannot_go():
    with pytest.raises(ValueError, match=r"quant.content.bits=\[4, 2\]: widths per group of RoPE frequency pairs"):
        cache_format(option("int4_joint", content={"bits": [4, 2]}), D_C, D_R)
    # the decode kernel reads widths per group of pairs (test_kernel.py), so backend=triton takes them
    assert cache_format(option("int4_joint", rope={"bits": [8, 2]}, backend="triton"), D_C, D_R).rope.format == "pairs"
    from mla_quant.quant.formats import PathFormat

    with pytest.raises(ValueError, match="on an even dimension"):
        PathFormat.from_cfg({"bits": [4, 2]}).check(15, "quant.rope")
    with pytest.raises(ValueError, match=r"rope_groups=3: the RoPE key has 16 channels \(8 pairs\)"):
        spec_of("quant.allocation.rope_groups=3")
    with pytest.raises(ValueError, match="each group of pairs takes a bit width"):
        spec_of("quant.allocation.rope_groups=2", "quant.choices.rope=[2,{bits: 4, symmetric: true}]")


def test_mixed_allocates_per_group_of_rope_pairs(tmp_path):
    """quant.allocation.rope_groups=2: each layer's RoPE key gets a width per group of 4 pairs, weighted by
    injections into those pairs alone; the cache stores format=pairs and holds exactly its bytes."""
    overrides = ["quant=mixed", "quant.budget=int2_joint", "quant.allocation.rope_groups=2",
                 f"quant.allocation.cache_dir={tmp_path}", "quant.allocation.sequences=2", "quant.allocation.seeds=1",
                 "calib.samples=8", "calib.seq_len=192"]
    prep = prepare_model(compose(overrides))
    m = prep.metrics()
    assert m["alloc/bytes_per_token_per_layer"] <= 44
    stored = json.loads(open(m["alloc/file"]).read())
    assert all(isinstance(layer["rope"], list) and len(layer["rope"]) == 2 for layer in stored["weights"])
    assert all(len(layer["rope"]) == 2 for layer in stored["picks"])
    pairs = [f for f in prep.fmt.layers if f.rope.format == "pairs"]
    assert pairs and all(len(f.rope.bits) == 2 for f in pairs)
    assert_holds_its_bytes(prep)
