"""`quant=mixed`: bits per cache layer and path from the model's sensitivity, under a byte budget.

    spec = mixed_spec(cfg.quant, d_c, d_r, num_layers, context, groups)   # validated before any weight is read
    fmt, metrics = allocate(model, spec, ids, identity, cache_dir)        # a CacheSpec, reused when stored

The predicted output error of an allocation is sum over layers l and paths p of w[l, p] x NMSE[l, p](bits): NMSE
measured with the real quantizer of each candidate width on the model's own cache latents over the calibration
batch (after the configured transforms, which the model already carries), and the weight `w` chosen by
`allocation.by`:

- `sensitivity`: the fixed-NMSE study's amplification of one layer and path, w = NMSE of the logits / injected cache
  NMSE with Gaussian noise in that layer and path alone (mean over `allocation.seeds`), measured on the first
  `allocation.sequences` calibration sequences, or read from a sensitivity run's `sensitivity_rows.csv`
  (`allocation.sensitivity`, the study run with task.per_layer=true) so a large model needs no new forwards;
- `cache_nmse`: w = 1 (the cache error alone, no amplification);
- `random`: w drawn uniformly in (0, 1) per layer and path from `allocation.seed` (the ablation: the same budget
  spent without the diagnostic).

The exact knapsack of mla_quant/quant/mixed.py minimises it under `quant.budget` (bytes per token per layer,
averaged over layers, of the quantized region with BF16 scales; or a uniform option's name: its bytes). The result
is stored as JSON with its provenance beside the fitted transforms and reused when the same configuration asks again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mla_quant.cache.bytes import load_quant_option
from mla_quant.checks import int_setting
from mla_quant.models.absorbed import cached_latents, new_cache
from mla_quant.quant.formats import (
    MIXED_KEYS,
    PATHS,
    CacheFormat,
    CacheSpec,
    PathFormat,
    _plain,
    cache_format,
    fake_quantizer,
    layered_format,
    pair_channels,
)
from mla_quant.quant.mixed import knapsack, pair_group_bytes, pairs_override, path_override, probe_override
from mla_quant.artifacts import Artifact, artifact
from mla_quant.sensitivity.injection import InjectionSpec, check_nmse_target, injection_factory, nmse
from mla_quant.sensitivity.study import capture, streamed_errors

BY = ("sensitivity", "cache_nmse", "random")
ALLOCATION_DEFAULTS = {"by": "sensitivity", "seed": 0, "sensitivity": None, "nmse": 0.01, "seeds": 2, "sequences": 8,
                       "rope_groups": 1, "file": None, "reuse": True, "cache_dir": "outputs/calibration"}
ALLOCATION_VERSION = 1


def is_mixed(quant_cfg) -> bool:
    return quant_cfg is not None and any(k in quant_cfg for k in MIXED_KEYS)


@dataclass(frozen=True)
class MixedSpec:
    """A validated `quant=mixed` option for a model: what the allocation may choose and how it chooses."""

    name: str
    base: dict  # the option without budget / choices / allocation: the paths' other settings, protected region, ...
    budget: float  # bytes per token per layer, averaged over layers (quantized region, BF16 scales)
    budget_name: str | None  # the uniform option the budget was read from, if named
    choices: dict  # path -> list of path blocks (each over the option's own block; see quant.mixed.path_override)
    allocation: dict  # the validated allocation block
    d_c: int
    d_r: int
    num_layers: int
    context: int | None
    rope_layout: str = "half"  # the model's RoPE pair layout (which channels a group of pairs holds)
    budget_format: CacheFormat | None = None  # the uniform option the budget names, if named (what transforms fit for)

    def dim(self, path: str) -> int:
        return {"content": self.d_c, "rope": self.d_r}[path]

    quantized = True

    @property
    def n_sink(self) -> int:
        return int((self.base.get("protected") or {}).get("n_sink", 0))

    @property
    def recent(self) -> int:
        return int((self.base.get("protected") or {}).get("recent", 0))

    @property
    def rope_groups(self) -> int:
        return int(self.allocation["rope_groups"])

    def units(self) -> list[tuple[str, int | None]]:
        """What each layer allocates: (path, None) for a whole path, (rope, g) for group g of the RoPE pairs."""
        if self.rope_groups == 1:
            return [(p, None) for p in PATHS]
        return [("content", None)] + [("rope", g) for g in range(self.rope_groups)]

    def channels(self, g: int) -> list[int]:
        return pair_channels(self.rope_layout, self.d_r, self.rope_groups)[g]

    def unit_format(self, path: str, g: int | None, k: int) -> PathFormat:
        """The format of choice `k` of a unit: the path's, or one group of pairs quantized as one int group."""
        if g is None:
            return self.path_format(path, k)
        block = {**_plain(self.base.get(path, {})), **self.choices[path][k], "group_size": None}
        return PathFormat.from_cfg(block, f"quant.choices.{path}[{k}]")

    def unit_cost(self, path: str, g: int | None, k: int) -> float:
        """Bytes per quantized token of a unit at choice `k` (a group of pairs: its byte-stream codes and its own
        scale and zero, as format=pairs stores it)."""
        if g is None:
            return self.cost(path, k)
        fmt = self.unit_format(path, g, k)
        return pair_group_bytes(fmt, len(self.channels(g)), 2)

    def path_format(self, path: str, k: int) -> PathFormat:
        """The format of choice `k` of `path`."""
        where = f"quant.choices.{path}[{k}]"
        fmt = PathFormat.from_cfg({**_plain(self.base.get(path, {})), **self.choices[path][k]}, where)
        fmt.check(self.dim(path), where)
        return fmt

    def cost(self, path: str, k: int) -> float:
        """Bytes per quantized token of `path` at choice `k` (BF16 scales and unquantized values, as the record's
        cache/bytes_per_token_per_layer)."""
        return self.path_format(path, k).bytes_per_token(self.dim(path), 2)

    def layered(self, picks: list[dict], source: str) -> CacheSpec:
        """Per layer {path: choice index, or for the RoPE key per group of pairs a list of them} -> the formats."""
        layers = [{p: (self.choices[p][k] if isinstance(k, int) else
                       pairs_override([self.choices[p][j]["bits"] for j in k]))
                   for p, k in layer.items()} for layer in picks]
        return layered_format(self.base, layers, self.d_c, self.d_r, self.context, self.num_layers, source=source,
                              rope_layout=self.rope_layout)


def _choice_list(value, where: str) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}={value!r}; allowed: a non-empty list of bit widths (16 = unquantized) or path "
                         f"blocks with bits (e.g. {{bits: 2, group_size: null}})")
    out = []
    for k, choice in enumerate(value):
        try:
            block = path_override(_plain(choice) if not isinstance(choice, (int, bool)) else choice)
        except ValueError as err:
            raise ValueError(f"{where}[{k}]: {err}") from err
        if block in out:
            raise ValueError(f"{where}[{k}]={choice!r} repeats an earlier choice")
        out.append(block)
    return out


def budget_bytes(budget, d_c: int, d_r: int, groups: dict | None) -> tuple[float, str | None, CacheFormat | None]:
    """quant.budget: a number of bytes per token per layer, or a uniform option's name (its bytes and its format)."""
    if isinstance(budget, str):
        option = load_quant_option(budget, groups=groups)  # an unknown name: refused with the allowed ones
        if is_mixed(option) or "peer" in option or option.get("layers") is not None:
            raise ValueError(f"quant.budget={budget!r}: allowed a uniform option of the project's formats (e.g. "
                             f"int2_content_int4_rope), or a number of bytes per token per layer")
        fmt = cache_format(option, d_c, d_r)
        return float(fmt.content.bytes_per_token(d_c, 2) + fmt.rope.bytes_per_token(d_r, 2)), budget, fmt
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"quant.budget={budget!r}; allowed: bytes per token per layer (> 0) or a uniform option's "
                         f"name, e.g. int2_content_int4_rope")
    return float(budget), None, None


def mixed_spec(quant_cfg, d_c: int, d_r: int, num_layers: int, context: int | None = None,
               groups: dict | None = None, rope_layout: str = "half") -> MixedSpec:
    """Validate a `quant=mixed` option against the model's dims, before any weight is read."""
    cfg = _plain(quant_cfg)
    name = cfg.get("name", "mixed")
    base = {k: v for k, v in cfg.items() if k not in MIXED_KEYS}
    if base.get("layers") is not None:
        raise ValueError(f"quant={name}: quant.layers and quant.budget both set the per-layer formats; allowed: one")
    base.pop("layers", None)
    for path in PATHS:
        fixed = sorted(set(_plain(base.get(path) or {})) & {"format", "bits"})
        if fixed:
            raise ValueError(f"quant.{path}.{fixed[0]}: quant={name} stores every path as format int at the widths "
                             f"of quant.choices.{path} (16 = unquantized); allowed: the block's other keys")
    # the base paths' other settings (at a width every integer quantizer takes; each choice is checked below) and
    # the protected region
    cache_format({**base, **{p: {**_plain(base.get(p) or {}), **probe_override()} for p in PATHS}},
                 d_c, d_r, context)
    choices = _plain(cfg.get("choices") or {})
    if set(choices) != set(PATHS):
        raise ValueError(f"quant.choices={choices!r}; allowed: a list of bit widths for each of {list(PATHS)}")
    choices = {p: _choice_list(choices[p], f"quant.choices.{p}") for p in PATHS}
    alloc = {**ALLOCATION_DEFAULTS, **_plain(cfg.get("allocation") or {})}
    unknown = sorted(set(alloc) - set(ALLOCATION_DEFAULTS))
    if unknown:
        raise ValueError(f"quant.allocation: unknown key(s) {unknown}; allowed: {list(ALLOCATION_DEFAULTS)}")
    if alloc["by"] not in BY:
        raise ValueError(f"quant.allocation.by={alloc['by']!r}; allowed: {list(BY)}")
    refuse_idle_allocation(alloc)
    check_nmse_target(alloc["nmse"])
    for key in ("seeds", "sequences", "rope_groups"):
        int_setting(alloc[key], f"quant.allocation.{key}")
    for key in ("sensitivity", "file"):
        if alloc[key] is not None and not Path(alloc[key]).exists():
            raise ValueError(f"quant.allocation.{key}={alloc[key]!r}: no such file or folder")
    if alloc["rope_groups"] > 1:
        g = alloc["rope_groups"]
        if d_r % 2 or (d_r // 2) % g:
            raise ValueError(f"quant.allocation.rope_groups={g}: the RoPE key has {d_r} channels ({d_r // 2} pairs); "
                             f"allowed: a number of groups dividing {d_r // 2}")
        plain = [c for c in choices["rope"] if c != path_override(c["bits"])]
        if plain:
            raise ValueError(f"quant.choices.rope={choices['rope']}: with quant.allocation.rope_groups={g} each group "
                             f"of pairs takes a bit width (one scale and zero per group); allowed: plain widths")
    budget, budget_name, named = budget_bytes(cfg.get("budget"), d_c, d_r, groups)
    spec = MixedSpec(name, base, budget, budget_name, choices, alloc, d_c, d_r, num_layers, context, rope_layout,
                     named)
    cheapest = sum(min(spec.unit_cost(p, g, k) for k in range(len(choices[p])))  # validates every choice
                   for p, g in spec.units())
    for p in PATHS:  # each choice as a whole layer format: the backend reads it, the protected region fits the context
        other = [q for q in PATHS if q != p][0]
        for k in range(len(choices[p])):
            pick = [k] * spec.rope_groups if p == "rope" and spec.rope_groups > 1 else k
            try:
                spec.layered([{p: pick, other: 0}] * num_layers, "quant.choices")
            except ValueError as err:
                raise ValueError(f"quant.choices.{p}[{k}]={choices[p][k]}: {err}") from err
    bf16 = float((d_c + d_r) * 2)
    if budget < cheapest:
        raise ValueError(f"quant.budget={cfg.get('budget')!r} ({budget:g} B/token/layer) is below the cheapest "
                         f"allocation of quant.choices ({cheapest:g}: every layer at its fewest bits)")
    if budget > bf16:
        raise ValueError(f"quant.budget={cfg.get('budget')!r} ({budget:g} B/token/layer) is above BF16's "
                         f"{bf16:g}; allowed: {cheapest:g} to {bf16:g}")
    return spec


def refuse_idle_allocation(alloc: dict) -> None:
    """An allocation setting that this run would not read, changed from its default, is refused by name."""
    measured = alloc["by"] == "sensitivity" and alloc["sensitivity"] is None
    idle = {}
    if alloc["file"] is not None:  # a stored allocation used as is: nothing is measured or stored
        why = f"quant.allocation.file={alloc['file']!r} is used as is"
        idle = {k: why for k in ALLOCATION_DEFAULTS if k not in ("file", "rope_groups")}
    else:
        if alloc["by"] != "random":
            idle["seed"] = f"quant.allocation.seed draws the weights of by=random; this run has by={alloc['by']}"
        if not measured:
            why = (f"the weights are read from {alloc['sensitivity']!r}" if alloc["by"] == "sensitivity" else
                   f"by={alloc['by']} measures no sensitivity")
            idle.update({k: f"quant.allocation.{k} sets the injections of by=sensitivity measured now; {why}"
                         for k in ("nmse", "seeds", "sequences")})
    for key, why in idle.items():
        if alloc[key] != ALLOCATION_DEFAULTS[key]:
            raise ValueError(f"quant.allocation.{key}={alloc[key]!r} would do nothing: {why}; drop it")


# ---------------------------------------------------------------------------------------------- measurements
@torch.no_grad()
def measure_nmse(model, ids: torch.Tensor, spec: MixedSpec, batch: int = 8, stream=None) -> dict[tuple, float]:
    """Cache NMSE of every choice of every unit, per layer, on the model's own latents over `ids` (every token
    quantized: the format's error, not the protected region's), relative to the whole path's energy (a group of
    pairs: its error over the RoPE key's energy, as the injection's NMSE is). `stream`: `model` streamed layer by
    layer (`cached_latents`). -> {(layer, path, g, choice): NMSE}"""
    err: dict = {}
    energy: dict = {}
    quantize = {}
    for p, g in spec.units():
        for k in range(len(spec.choices[p])):
            fmt = spec.unit_format(p, g, k)
            d = spec.dim(p) if g is None else len(spec.channels(g))
            quantize[p, g, k] = fake_quantizer(fmt, d, path=p)
    for i, read in cached_latents(model, ids, batch, desc="allocation: cache NMSE", stream=stream):
        latents = {p: x.float() for p, x in zip(PATHS, read)}
        for p, x in latents.items():
            energy[i, p] = energy.get((i, p), 0.0) + x.double().pow(2).sum().item()
        for (p, g, k), fq in quantize.items():
            x = latents[p] if g is None else latents[p][..., spec.channels(g)]
            err[i, p, g, k] = err.get((i, p, g, k), 0.0) + (fq(x).double() - x.double()).pow(2).sum().item()
    return {key: e / energy[key[0], key[1]] for key, e in err.items()}


@torch.no_grad()
def measure_sensitivity(model, ids: torch.Tensor, spec: MixedSpec, stream=None) -> dict[tuple[int, str], float]:
    """Per layer and unit: logits NMSE / injected cache NMSE, Gaussian noise in that layer and unit alone (a group
    of RoPE pairs: noise on its pairs only, at that NMSE of the whole key). `stream`: `model` streamed layer by
    layer, every injection's stream beside the clean one in one pass (`study.streamed_errors`).
    -> {(layer, path, g): weight}"""
    alloc = spec.allocation
    per = spec.d_r // 2 // spec.rope_groups
    jobs = [(i, p, g, s) for i in range(spec.num_layers) for p, g in spec.units() for s in range(alloc["seeds"])]
    injections = [InjectionSpec(path=p, nmse=float(alloc["nmse"]), layers={i}, seed=s, rope_layout=spec.rope_layout,
                                pair=None if g is None else tuple(range(g * per, (g + 1) * per)))
                  for i, p, g, s in jobs]
    if stream is not None:
        ids = ids[:alloc["sequences"]]
        _, errors = streamed_errors(stream, ids, new_cache(model), [new_cache(model, injection_factory(inj))
                                                                    for inj in injections],
                                    desc="allocation: sensitivity (streamed)")
        logits_nmse = [e["logits"] for e in errors]
    else:
        ids = ids[:alloc["sequences"]].to(model.device)
        clean = capture(model, ids, new_cache(model))
        logits_nmse = [nmse(capture(model, ids, new_cache(model, injection_factory(inj))).logits, clean.logits)
                       for inj in tqdm(injections, desc="allocation: sensitivity", unit="injection")]
    slopes: dict = {}
    for (i, p, g, _), inj, value in zip(jobs, injections, logits_nmse):
        slopes.setdefault((i, p, g), []).append(value / inj.achieved[i])
    return {key: sum(v) / len(v) for key, v in slopes.items()}


def sensitivity_from_record(source: str | Path, num_layers: int, model_identity: dict | None = None,
                            rope_groups: int = 1) -> dict[tuple[int, str, int | None], float]:
    """Per layer and unit amplification from a sensitivity run (its folder or its sensitivity_rows.csv): the
    one-layer injections (task.per_layer=true; with rope_groups=G > 1 the RoPE key's from the injections into each
    group of its pairs, task.rope_groups=G), logits NMSE / injected NMSE, mean over seeds. -> {(layer, path, g)}"""
    import pandas as pd

    path = Path(source)
    rows_file = path / "sensitivity_rows.csv" if path.is_dir() else path
    if not rows_file.is_file():
        raise ValueError(f"quant.allocation.sensitivity={str(source)!r}: no sensitivity_rows.csv there")
    record = rows_file.parent / "record.json"
    if model_identity is not None and record.is_file():
        theirs = json.loads(record.read_text()).get("config", {}).get("model", {})
        differ = sorted(k for k in model_identity if k in theirs and theirs[k] != model_identity[k])
        if differ:
            raise ValueError(f"quant.allocation.sensitivity={str(source)!r} was measured on another model "
                             f"(model.{differ[0]}: {theirs[differ[0]]!r} there, {model_identity[differ[0]]!r} here)")
    df = pd.read_csv(rows_file)
    one = df[(df.kind == "one_layer") & (df.site == "logits")]
    if one.empty:
        raise ValueError(f"{rows_file}: no one-layer injections (run the study with task.per_layer=true)")
    slope = (one.value / one.nmse_target).groupby([one.layer, one.path]).mean()
    found = {(int(i), str(p)) for i, p in slope.index}
    wanted = {(i, p) for i in range(num_layers) for p in PATHS}
    if found != wanted:
        layers = sorted({i for i, _ in found})
        raise ValueError(f"{rows_file}: one-layer sensitivity of layers {layers} (paths "
                         f"{sorted({p for _, p in found})}); the model has {num_layers} cache layers x {list(PATHS)}")
    out = {(int(i), str(p), None): float(v) for (i, p), v in slope.items()}
    if rope_groups == 1:
        return out
    if "groups" in df.columns:  # a study run with task.rope_groups (older runs have no such column)
        grouped = df[(df.kind == "one_layer_group") & (df.site == "logits")]
        sel, measured = grouped[grouped.groups == rope_groups], sorted(int(g) for g in grouped.groups.unique())
    else:
        sel, measured = df.iloc[:0], []
    if sel.empty:
        raise ValueError(f"{rows_file}: no injections into {rope_groups} groups of RoPE pairs (groups measured: "
                         f"{measured or 'none'}); run the study with task.rope_groups={rope_groups}")
    groups = (sel.value / sel.nmse_target).groupby([sel.layer, sel.group]).mean()
    if {(int(i), int(g)) for i, g in groups.index} != {(i, g) for i in range(num_layers) for g in range(rope_groups)}:
        raise ValueError(f"{rows_file}: the group injections cover layers {sorted({int(i) for i, _ in groups.index})}"
                         f"; the model has {num_layers} cache layers")
    return {**{k: v for k, v in out.items() if k[1] != "rope"},
            **{(int(i), "rope", int(g)): float(v) for (i, g), v in groups.items()}}


# ---------------------------------------------------------------------------------------------- allocation
def solve(spec: MixedSpec, nmse_table: dict, weights: dict) -> tuple[list[dict], float, float]:
    """The exact allocation: -> (per layer {path: choice index, or a list of them per group of RoPE pairs}, mean
    bytes per token per layer, predicted error)."""
    groups, options = [], []
    for i in range(spec.num_layers):
        for p, g in spec.units():
            groups.append((i, p, g))
            options.append([(spec.unit_cost(p, g, k), weights[i, p, g] * nmse_table[i, p, g, k])
                            for k in range(len(spec.choices[p]))])
    picks, cost, error = knapsack(options, spec.budget * spec.num_layers)
    chosen = [dict() for _ in range(spec.num_layers)]
    for (i, p, g), k in zip(groups, picks):
        if g is None:
            chosen[i][p] = k
        else:
            chosen[i].setdefault(p, []).append(k)
    return chosen, cost / spec.num_layers, error


def _weights(spec: MixedSpec, model, ids, identity, stream=None) -> tuple[dict, str]:
    by, alloc = spec.allocation["by"], spec.allocation
    keys = [(i, p, g) for i in range(spec.num_layers) for p, g in spec.units()]
    if by == "cache_nmse":
        return {k: 1.0 for k in keys}, "none (cache NMSE alone)"
    if by == "random":
        g = torch.Generator().manual_seed(int(alloc["seed"]))
        draws = torch.rand(len(keys), generator=g, dtype=torch.float64).tolist()
        return dict(zip(keys, draws)), f"random, seed {alloc['seed']}"
    if alloc["sensitivity"] is not None:
        slopes = sensitivity_from_record(alloc["sensitivity"], spec.num_layers, identity.get("model"),
                                         spec.rope_groups)
        return slopes, str(alloc["sensitivity"])
    return measure_sensitivity(model, ids, spec, stream), (f"measured: Gaussian NMSE {alloc['nmse']:g}, {alloc['seeds']} "
                                                   f"seeds, {min(alloc['sequences'], ids.shape[0])} sequences")


def allocation_artifact(spec: MixedSpec, identity: dict) -> Artifact:
    payload = {"version": ALLOCATION_VERSION, "identity": identity, "budget": spec.budget, "choices": spec.choices,
               # the paths' settings only: the protected region, mode and backend change no measured figure
               "base": {p: spec.base.get(p) for p in PATHS}, "allocation": {k: v for k, v in spec.allocation.items()
                                                 if k not in ("file", "reuse", "cache_dir")}}
    return artifact(spec.allocation["cache_dir"], f"mixed-{spec.allocation['by']}", payload, ".json")


def _dims(spec: MixedSpec) -> dict:
    return {"d_c": spec.d_c, "d_r": spec.d_r, "layers": spec.num_layers}


def load_allocation(path: Path, spec: MixedSpec) -> dict:
    """A named allocation file (`allocation.file`) for this model's dims and layers; anything else is refused."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"quant.allocation.file={str(path)!r} is not an allocation ({err})") from err
    dims = _dims(spec)
    theirs = {k: stored.get("dims", {}).get(k) for k in dims}
    if theirs != dims:
        raise ValueError(f"quant.allocation.file={str(path)!r} is for dims {theirs}; this model has {dims}")
    return stored


def _measured(model, spec: MixedSpec, ids: torch.Tensor, identity: dict, batch: int, source: str,
              stream=None) -> dict:
    """The allocation of `spec` measured on `model` and solved: what the store keeps of it."""
    start = time.perf_counter()
    table = measure_nmse(model, ids, spec, batch, stream)
    weights, weight_source = _weights(spec, model, ids, identity, stream)
    picks, mean_bytes, predicted = solve(spec, table, weights)
    fmt = spec.layered(picks, source=source)

    def per_unit(values, i, p):  # a whole path's value, or the list over its groups of pairs
        keys = [g for q, g in spec.units() if q == p]
        return values(i, p, None) if keys == [None] else [values(i, p, g) for g in keys]

    n = {p: len(spec.choices[p]) for p in PATHS}
    return {"version": ALLOCATION_VERSION, "identity": identity, "dims": _dims(spec),
            "budget": spec.budget, "budget_name": spec.budget_name, "by": spec.allocation["by"],
            "rope_groups": spec.rope_groups, "weights_from": weight_source, "choices": spec.choices,
            "picks": picks, "layers": fmt.describe(),
            "bits": [{p: (list(b) if isinstance(b := f.path(p).bits, tuple) else b) for p in PATHS}
                     for f in fmt.layers],
            "bytes": [{p: f.path(p).bytes_per_token(f.dim(p), 2) for p in PATHS} for f in fmt.layers],
            "bytes_per_token_per_layer": mean_bytes, "predicted_error": predicted,
            "weights": [{p: per_unit(lambda i, p, g: weights[i, p, g], i, p) for p in PATHS}
                        for i in range(spec.num_layers)],
            "nmse": [{p: per_unit(lambda i, p, g: [table[i, p, g, k] for k in range(n[p])], i, p)
                      for p in PATHS} for i in range(spec.num_layers)],
            "seconds": time.perf_counter() - start, "torch": torch.__version__}


def allocate(model, spec: MixedSpec, ids: torch.Tensor, identity: dict, batch: int = 8, stream=None
             ) -> tuple[CacheSpec, dict]:
    """The per-layer format of `spec` for `model` (transforms applied), and its record metrics. `stream`: `model`
    is the skeleton of a model streamed layer by layer (a pass over its layers for the cache NMSE, one more for
    the measured sensitivity; the same allocation)."""
    alloc = spec.allocation
    if alloc["file"] is not None:
        path, stored, reused = Path(alloc["file"]), load_allocation(Path(alloc["file"]), spec), True
        if identity.get("model") != stored.get("identity", {}).get("model"):
            raise ValueError(f"quant.allocation.file={alloc['file']!r} was allocated for another model "
                             f"({stored.get('identity', {}).get('model')}); this run's is {identity.get('model')}")
    else:
        art = allocation_artifact(spec, identity)
        path = art.path
        with art.held():  # a job allocating the same configuration is waited for, and its file reused
            stored = art.read_json() if alloc["reuse"] else None
            if stored is not None and stored.get("dims") != _dims(spec):
                stored = None
            reused = stored is not None
            if reused:
                print(f"[allocate] reusing {path}")
            else:
                stored = art.write_json(_measured(model, spec, ids, identity, batch, str(path), stream))
                figure(stored, path.with_suffix(".png"))
                print(f"[allocate] {alloc['by']}: {spec.num_layers} layers, {stored['bytes_per_token_per_layer']:.2f} "
                      f"of {spec.budget:.2f} B/token/layer -> {path}")
    if stored.get("choices") != spec.choices:
        raise ValueError(f"{path}: allocated over quant.choices {stored.get('choices')}; this run's are {spec.choices}")
    fmt = spec.layered(stored["picks"], source=str(path))
    return fmt, allocation_metrics(stored, path, reused)


def figure(stored: dict, path: Path) -> Path:
    """Bits per layer and path of an allocation, with the weight (amplification) that chose them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = range(len(stored["bits"]))
    fig, (ax, aw) = plt.subplots(1, 2, figsize=(9, 3.2))
    mean = lambda v: sum(v) / len(v) if isinstance(v, list) else v  # noqa: E731  (groups of RoPE pairs: their mean)
    for k, p in enumerate(PATHS):
        ax.bar([i + (k - 0.5) * 0.4 for i in layers], [mean(stored["bits"][i][p]) for i in layers], width=0.4,
               label=p if not isinstance(stored["bits"][0][p], list) else f"{p} (mean over groups of pairs)")
        w = [stored["weights"][i][p] for i in layers]
        for g, series in enumerate(zip(*w) if isinstance(w[0], list) else [w]):
            aw.plot(list(layers), list(series), "o-", label=p if not isinstance(w[0], list) else f"{p} group {g}")
    ax.set(xlabel="cache layer", ylabel="bits", xticks=list(layers))
    ax.set_title(f"{stored['bytes_per_token_per_layer']:.1f} of {stored['budget']:.1f} B/token/layer "
                 f"({stored['by']})", fontsize=10)
    aw.set(xlabel="cache layer", ylabel="weight (output / cache NMSE)", yscale="log", xticks=list(layers))
    aw.set_title(f"weights: {stored['weights_from']}", fontsize=8, wrap=True)
    ax.legend(), aw.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def allocation_metrics(stored: dict, path: Path, reused: bool) -> dict:
    m = {"alloc/by": stored["by"], "alloc/file": str(path), "alloc/figure": str(path.with_suffix(".png")),
         "alloc/reused": int(reused),
         "alloc/budget": float(stored["budget"]), "alloc/bytes_per_token_per_layer":
             float(stored["bytes_per_token_per_layer"]), "alloc/predicted_error": float(stored["predicted_error"]),
         "alloc/seconds": float(stored.get("seconds", 0.0)), "alloc/weights_from": stored["weights_from"]}
    if stored.get("budget_name"):
        m["alloc/budget_name"] = stored["budget_name"]
    for i, (layer, shown) in enumerate(zip(stored["bits"], stored["layers"])):
        for p, b in layer.items():  # a list over groups of RoPE pairs: their mean
            m[f"alloc/layer{i}/{p}_bits"] = sum(b) / len(b) if isinstance(b, list) else int(b)
            m[f"alloc/layer{i}/{p}"] = shown[p]
    return m
