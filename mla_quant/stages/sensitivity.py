"""The fixed-NMSE sensitivity study: how much more output error a RoPE-key cache error causes than a content one.

    python run.py experiment=sensitivity model=tiny_deepseek_v2
    python run.py experiment=sensitivity model=tiny_minicpm3 task.nmse=0.02 task.seeds=5
    python run.py experiment=sensitivity task.noise=quantizer quant=int4_joint    # real INT4 error, rescaled

Parts (docs/method.md section 2): (1) inject into the content latent or the RoPE key, all layers at once and one layer at
a time, rescaled to the target cache NMSE exactly; (2) output NMSE at the attention output, the layer output and
the logits, next-token KL, and the amplification A = NMSE_out(RoPE) / NMSE_out(content), mean and spread over seeds;
(3) the content mechanism split (score side = match, value side = aggregation, both; coupling = both - match -
aggregation) and the RoPE error per frequency pair; (4) the analytical predictor beside the measured A per layer.
Writes record metrics (`sensitivity/...`), sensitivity.md, sensitivity_rows.csv and PNG figures in the run dir.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from mla_quant.metrics import layer_key, sweep_key
from mla_quant.models.absorbed import new_cache  # noqa: E402
from mla_quant.prepare import check_context, model_dims, preflight, prepare_model, refuse_unstreamed  # noqa: E402
from mla_quant.quant.formats import PATHS  # noqa: E402
from mla_quant.stages import StageResult, refuse_overrides  # noqa: E402
from mla_quant.record import atomic_path, progress, write_text_atomic  # noqa: E402
from mla_quant.sensitivity.injection import InjectionSpec, check_nmse_target, injection_factory  # noqa: E402
from mla_quant.sensitivity.study import (  # noqa: E402
    RecordingLatentLayer,
    capture,
    output_errors,
    predicted_score_error,
    probe_ids,
    streamed_errors,
)

SITES = ("logits", "kl")


def key_paths(dims: dict[str, int]) -> list[str]:
    """The paths a model caches: both, or the content path alone where there is no RoPE key (qk_rope_head_dim 0)."""
    return [p for p in PATHS if dims[p] > 0]


def noise_quantizers(cfg: DictConfig, dims: dict[str, int]) -> dict:
    """Per path, x -> fake-quantized x in the format `quant.<path>` describes (for task.noise=quantizer)."""
    from mla_quant.quant.formats import PathFormat, fake_quantizer  # the quantized-cache formats
    from mla_quant.quant.peers import refuse_peer

    refuse_peer(cfg.quant, "task.noise=quantizer (noise of the format's own error shape)")
    per_layer = [k for k in ("layers", "budget") if cfg.quant.get(k) is not None]
    if per_layer:
        raise ValueError(f"task.noise=quantizer injects one format's error shape, rescaled, into every layer; "
                         f"quant={cfg.quant.name} sets formats per layer (quant.{per_layer[0]}): use a uniform "
                         f"option (e.g. int2_content_int4_rope)")
    fmts = {path: PathFormat.from_cfg(cfg.quant[path], f"quant.{path}") for path in key_paths(dims)}
    for path, fmt in fmts.items():
        if not fmt.quantized:
            raise ValueError(f"task.noise=quantizer needs quant.{path}.format int or fp8; quant={cfg.quant.name} "
                             f"keeps the {path} path in bf16 (lossless), e.g. use quant=int4_joint")
    return {path: fake_quantizer(fmt, dims[path], path=path) for path, fmt in fmts.items()}


def validate(cfg: DictConfig) -> list[float]:
    """Check the study's options (and, for quantizer noise, the formats) before any model work."""
    task = cfg.task
    targets = sorted({check_nmse_target(t) for t in [task.nmse, *task.sweep_nmse]})
    if int(task.seeds) < 1:
        raise ValueError(f"task.seeds={task.seeds}; need at least 1")
    if task.noise not in ("gaussian", "quantizer"):
        raise ValueError(f"task.noise={task.noise!r}; allowed: gaussian, quantizer")
    check_context("task.probe.seq_len", task.probe.seq_len, model_dims(cfg.model))
    groups = task.get("rope_groups")
    if groups is not None:
        pairs = sorted({d_r // 2 for _, d_r in model_dims(cfg.model)["layer_dims"]} - {0})  # per layer with RoPE
        if not pairs:
            raise ValueError(f"task.rope_groups={groups!r}: the model has no RoPE key (qk_rope_head_dim 0), so there "
                             "are no RoPE pairs to group; use task.rope_groups=null")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or any(n % groups for n in pairs):
            what = " or ".join(str(n) for n in pairs)
            raise ValueError(f"task.rope_groups={groups!r}; allowed: null (off) or a number of groups dividing the "
                             f"RoPE key's {what} frequency pairs")
    if task.noise == "gaussian":
        refuse_overrides(["quant"], "task.noise=gaussian injects Gaussian noise and reads no quant setting (use "
                                    "task.noise=quantizer to inject the error of quant.<path>)")
    else:
        dims = model_dims(cfg.model)
        noise_quantizers(cfg, {"content": dims["d_c"], "rope": dims["d_r"]})
    return targets


def _rows(errors: dict, **key) -> list[dict]:
    rows = [dict(key, site=site, value=errors[site]) for site in SITES]
    for site in ("attn_output", "layer_output"):
        rows += [dict(key, site=f"{site}/{i}", value=v) for i, v in enumerate(errors[site])]
    return rows


def check(cfg: DictConfig) -> list[float]:
    """Everything this stage refuses, before any weight is read: the study's options, then the model's settings
    (`preflight`). -> the NMSE targets."""
    refuse_unstreamed(cfg)  # model.streaming=true: before the study's options read the model's config
    targets = validate(cfg)
    probe = cfg.task.probe
    preflight(cfg, quant=cfg.task.noise == "quantizer", tokenizer=probe.source != "random")
    if probe.source == "tasks" or (probe.source == "auto" and cfg.model.get("tokenizer") is not None):
        from mla_quant.models.build import load_tokenizer

        try:  # the needle prompts the run will probe with fit task.probe.seq_len, or are refused by name now
            probe_ids(OmegaConf.merge(probe, {"source": "tasks"}), None, load_tokenizer(cfg.model))
        except ValueError as err:
            raise ValueError(f"task.probe.seq_len={probe.seq_len} (task.probe.source={probe.source}, needle prompts "
                             f"of task.probe.task={probe.get('task', 'multikey_1')}): {err}") from err
    return targets


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    targets = check(cfg)  # bad targets, formats and data fail here, before any model work
    headline = float(task.nmse)
    stream = None
    if cfg.model.get("streaming"):  # the model read layer by layer from its shards (mla_quant.models.streaming)
        from mla_quant.prepare import prepare_streamed

        stream, prep = prepare_streamed(cfg, quant=task.noise == "quantizer", tokenizer=task.probe.source != "random")
        model, tokenizer = stream.model, prep.tokenizer
    else:
        prep = prepare_model(cfg, quant=task.noise == "quantizer", tokenizer=task.probe.source != "random")
        model, tokenizer = prep.model, prep.tokenizer
    n_layers = prep.dims["layers"]
    dims = {"content": prep.dims["d_c"], "rope": prep.dims["d_r"]}
    quantizers = noise_quantizers(cfg, dims) if task.noise == "quantizer" else {}
    layout = model.mla_family.cached_rope_layout(model.config)
    probe = task.probe
    if probe.source == "auto":
        probe = OmegaConf.merge(probe, {"source": "tasks" if tokenizer is not None else "random"})
    ids = probe_ids(probe, model, tokenizer).to(stream.device if stream else model.device)
    clean = None if stream else capture(model, ids, new_cache(model, RecordingLatentLayer))
    seeds = range(int(task.seeds))

    rows, specs = [], []
    groups = int(task.rope_groups or 0)  # task.rope_groups: one layer and one group of RoPE pairs at a time

    def spec_of(kw: dict) -> InjectionSpec:
        """A job's injection (its `group` labels the rows; the pairs it names are the injection's)."""
        return InjectionSpec(shape=task.noise, rope_layout=layout, quantizer=quantizers.get(kw["path"]),
                             **{k: v for k, v in kw.items() if k != "group"})

    def result(kw: dict, kind: str, group: int, spec: InjectionSpec, errors: dict) -> dict:
        """What summarise reads of one injection: its rows, the achieved NMSE per layer, the error energy of an
        injected single layer."""
        pair = kw.get("pair", -1)
        key = dict(kind=kind, path=kw["path"], nmse_target=kw["nmse"], seed=kw.get("seed", 0),
                   layer=-1 if kw.get("layers") is None else min(kw["layers"]),
                   side=kw.get("side", "both"), pair=pair if isinstance(pair, int) else -1,
                   group=group, groups=groups if group >= 0 else 0)
        return {"rows": _rows(errors, **key), "key": key, "achieved": spec.achieved,
                "error_energy": {i: spec.error_energy[i].tolist() for i in kw.get("layers") or ()}}

    def inject(kind: str, group: int = -1, **kw):
        spec = spec_of(kw)
        return result(kw, kind, group, spec, output_errors(capture(model, ids, new_cache(model,
                                                                                         injection_factory(spec))),
                                                           clean))

    streamed = {}

    def kept(i: int, kind: str, kw: dict):
        """One injection, kept in the run's progress (an interruption keeps it, a rerun does not redo it)."""
        done = progress().unit(f"sensitivity/{kind}/{i}",
                               (lambda: streamed[i]) if stream else (lambda: inject(kind, **kw)),
                               metrics=lambda _: {"sensitivity/injections_done": i + 1})
        spec = spec_of(kw)  # the finished injection's figures, fresh or read back from the progress
        spec.achieved = {int(k): v for k, v in done["achieved"].items()}
        spec.error_energy = {int(k): torch.tensor(v, dtype=torch.float64) for k, v in done["error_energy"].items()}
        rows.extend(done["rows"])
        specs.append((done["key"], spec))

    paths = key_paths(dims)
    # a layer without a RoPE key (Mistral Large 4's NoPE layers) is injected on its content alone
    no_rope = [i for i, (_, d_r) in enumerate(prep.dims["layer_dims"]) if d_r == 0] if dims["rope"] else []
    roped = [i for i in range(n_layers) if i not in no_rope]
    jobs = [("all_layers", dict(path=p, nmse=t, seed=s)) for t in targets for s in seeds for p in paths]
    if task.per_layer:
        jobs += [("one_layer", dict(path=p, nmse=headline, seed=s, layers={i}))
                 for i in range(n_layers) for s in seeds for p in paths if p == "content" or i in roped]
    if task.mechanism:
        jobs += [("mechanism", dict(path="content", nmse=headline, seed=s, side=side))
                 for side in ("score", "value") for s in seeds]
    if task.rope_pairs and dims["rope"]:  # without a RoPE key the table says the per-pair study was skipped
        jobs += [("rope_pair", dict(path="rope", nmse=headline, seed=s, pair=i))
                 for i in range(dims["rope"] // 2) for s in seeds]
    if groups:  # quant=mixed quant.allocation.rope_groups reads these
        per = [d_r // 2 // groups for _, d_r in prep.dims["layer_dims"]]  # each layer's own pairs per group
        jobs += [("one_layer_group", dict(path="rope", nmse=headline, seed=s, layers={i}, group=g,
                                          pair=tuple(range(g * per[i], (g + 1) * per[i]))))
                 for i in roped for g in range(groups) for s in seeds]
    if stream is not None:  # every injection in one pass over the layers (each job's stream beside the clean one)
        todo = [(i, kind, kw) for i, (kind, kw) in enumerate(jobs)
                if f"sensitivity/{kind}/{i}" not in progress().units]
        specs_todo = [(i, kind, {k: v for k, v in kw.items() if k != "group"}, kw.get("group", -1),
                       spec_of(kw)) for i, kind, kw in todo]
        clean, errors = streamed_errors(stream, ids, new_cache(model, RecordingLatentLayer),
                                        [new_cache(model, injection_factory(sp)) for *_, sp in specs_todo],
                                        scratch=run_dir)
        stream.close()
        for (i, kind, kw, group, sp), err in zip(specs_todo, errors):
            streamed[i] = result(kw, kind, group, sp, err)
    for i, (kind, kw) in enumerate(tqdm(jobs, desc="sensitivity", unit="injection")):
        kept(i, kind, kw)

    df = pd.DataFrame(rows)
    with atomic_path(run_dir / "sensitivity_rows.csv") as tmp:
        df.to_csv(tmp, index=False)
    family = model.mla_family
    metrics, tables = summarise(df, specs, clean, headline, n_layers, attention_layer_of=clean.layer_of_attention,
                                unrotated=None if family.rotary else family.name,
                                no_rope=family.name if dims["rope"] == 0 else None, no_rope_layers=no_rope)
    metrics = {**(prep.transform_metrics or {}), **(prep.plan_metrics or {}), **metrics,
               **(stream.figures() if stream else {})}
    write_text_atomic(run_dir / "sensitivity.md", tables)
    figures(df, metrics, headline, n_layers, run_dir)
    print(tables)
    return StageResult(metrics=metrics)


def _ratio_over_seeds(df: pd.DataFrame, site: str, **where) -> pd.Series:
    sel = df[(df.site == site) & _match(df, where)]
    wide = sel.pivot_table(index="seed", columns="path", values="value")
    return wide["rope"] / wide["content"]


def _match(df, where):
    mask = pd.Series(True, index=df.index)
    for k, v in where.items():
        mask &= df[k] == v
    return mask


def summarise(df, specs, clean, headline, n_layers, attention_layer_of, unrotated: str | None = None,
              no_rope: str | None = None, no_rope_layers: list[int] = ()):
    """The metrics and the markdown tables. `unrotated`: the family name where the second key path is not rotated
    (the "RoPE" path is then a shared NoPE key, its pairs pairs of dims); `no_rope`: the family name where there is
    no second key path at all (the content path alone: no amplification, no pairs); `no_rope_layers`: the layers
    without a RoPE key in a model whose other layers have one (injected into the RoPE key of the others only, and
    on their content alone when one layer at a time)."""
    if no_rope:
        return _summarise_content(df, specs, headline, n_layers, no_rope)
    m = _path_metrics(df, specs, headline, PATHS)
    allh = dict(kind="all_layers", nmse_target=headline)
    for site in SITES:
        a = _ratio_over_seeds(df, site, **allh)
        name = "logits" if site == "logits" else "kl"
        m[f"sensitivity/amplification/{name}"] = a.mean()
        m[f"sensitivity/amplification/{name}_std"] = a.std(ddof=0)
    for t in sorted(df.nmse_target.unique()):
        a = _ratio_over_seeds(df, "logits", kind="all_layers", nmse_target=t)
        m[sweep_key(t, "amplification", "logits")] = a.mean()

    lines = [f"# Fixed-NMSE sensitivity (cache NMSE {headline:g}, {df.seed.nunique()} seeds)\n",
             *([f"{unrotated}'s second key path is not rotated (no RoPE): \"RoPE\" below names that shared key, "
                "and its pairs are pairs of dims, not frequencies.\n"] if unrotated else []),
             *([f"MLA layers {list(no_rope_layers)} have no RoPE key (NoPE layers: the cache holds their content "
                "latent alone): RoPE errors are injected into the other layers' keys only.\n"]
               if no_rope_layers else []),
             "| injected | output NMSE content | output NMSE RoPE | amplification (mean ± std) |", "|---|---|---|---|"]
    lines.append(f"| all layers, logits | {m['sensitivity/output_nmse/content/logits']:.3g} | "
                 f"{m['sensitivity/output_nmse/rope/logits']:.3g} | {m['sensitivity/amplification/logits']:.2f} ± "
                 f"{m['sensitivity/amplification/logits_std']:.2f} |")
    lines.append(f"| all layers, next-token KL | {m['sensitivity/kl/content']:.3g} | {m['sensitivity/kl/rope']:.3g} | "
                 f"{m['sensitivity/amplification/kl']:.2f} ± {m['sensitivity/amplification/kl_std']:.2f} |")

    if (df.kind == "one_layer").any():
        lines += ["", "## One layer at a time", "",
                  "| layer | A attention output | A layer output | A logits | predicted A (score) |", "|---|---|---|---|---|"]
        for i in range(n_layers):
            one = dict(kind="one_layer", layer=i)
            if i in no_rope_layers:
                v = df[(df.site == "logits") & (df.path == "content") & _match(df, one)].value.mean()
                m[layer_key(i, "output_nmse/content/logits")] = v
                lines.append(f"| {i} | no RoPE key (content alone: logits NMSE {v:.3g}) | | | |")
                continue
            a_attn = _ratio_over_seeds(df, f"attn_output/{i}", **one)
            a_layer = _ratio_over_seeds(df, f"layer_output/{attention_layer_of[i]}", **one)
            a_logits = _ratio_over_seeds(df, "logits", **one)
            pred = predicted_amplification(specs, clean, i)
            m[layer_key(i, "amplification/attn_output")] = a_attn.mean()
            m[layer_key(i, "amplification/attn_output_std")] = a_attn.std(ddof=0)
            m[layer_key(i, "amplification/layer_output")] = a_layer.mean()
            m[layer_key(i, "amplification/logits")] = a_logits.mean()
            m[layer_key(i, "predicted_amplification")] = pred
            lines.append(f"| {i} | {a_attn.mean():.2f} ± {a_attn.std(ddof=0):.2f} | {a_layer.mean():.2f} | "
                         f"{a_logits.mean():.2f} | {pred:.2f} |")

    if (df.kind == "one_layer_group").any():
        groups = int(df[df.kind == "one_layer_group"].groups.iloc[0])
        lines += ["", f"## RoPE key, one layer and one group of pairs at a time ({groups} groups; group 0 = the "
                      "highest frequencies): logits NMSE / injected cache NMSE of the whole key", "",
                  "| layer | " + " | ".join(f"group {g}" for g in range(groups)) + " |", "|---|" + "---|" * groups]
        for i in range(n_layers):
            if i in no_rope_layers:
                lines.append(f"| {i} | " + " | ".join(["no RoPE key"] * groups) + " |")
                continue
            row = []
            for g in range(groups):
                sel = df[(df.site == "logits") & _match(df, dict(kind="one_layer_group", layer=i, group=g))]
                slope = float((sel.value / sel.nmse_target).mean())
                m[layer_key(i, f"rope_group{g}/logits_per_cache_nmse")] = slope
                row.append(f"{slope:.3g}")
            lines.append(f"| {i} | " + " | ".join(row) + " |")

    lines += _mechanism(df, m)

    if (df.kind == "rope_pair").any():
        pairs = (df[(df.site == "logits") & (df.kind == "rope_pair")].groupby("pair").value.mean())
        lines += ["", "## RoPE error per frequency pair (all layers, logits NMSE; pair 0 = highest frequency)", "",
                  "| pair | logits NMSE |", "|---|---|"]
        for pair, v in pairs.items():
            m[f"sensitivity/rope_pair/{int(pair)}/logits"] = v
            lines.append(f"| {int(pair)} | {v:.3g} |")
        m["sensitivity/rope_pair/most_sensitive"] = int(pairs.idxmax())
    return m, "\n".join(lines) + "\n"


def _summarise_content(df, specs, headline, n_layers, family: str):
    """`summarise` for a model without a RoPE key: the content path's output error, per layer when injected alone,
    and the mechanism split; the table says why there is no amplification."""
    m = _path_metrics(df, specs, headline, ("content",))
    lines = [f"# Fixed-NMSE sensitivity (cache NMSE {headline:g}, {df.seed.nunique()} seeds)\n",
             f"{family} has no RoPE key (qk_rope_head_dim 0): the cache holds the content latent alone, so this "
             "study measures the content path only; there is no RoPE/content amplification and no per-pair study "
             "(task.rope_pairs is skipped).\n",
             "| injected | output NMSE content |", "|---|---|",
             f"| all layers, logits | {m['sensitivity/output_nmse/content/logits']:.3g} |",
             f"| all layers, next-token KL | {m['sensitivity/kl/content']:.3g} |"]
    if (df.kind == "one_layer").any():
        lines += ["", "## One layer at a time (logits NMSE)", "", "| layer | logits NMSE |", "|---|---|"]
        for i in range(n_layers):
            v = df[(df.site == "logits") & _match(df, dict(kind="one_layer", layer=i))].value.mean()
            m[layer_key(i, "output_nmse/content/logits")] = v
            lines.append(f"| {i} | {v:.3g} |")
    lines += _mechanism(df, m)
    return m, "\n".join(lines) + "\n"


def _path_metrics(df, specs, headline, paths) -> dict[str, float]:
    """Per injected path: the achieved cache NMSE at the headline target (mean, worst relative error), the output
    NMSE of the logits and the next-token KL when every layer is injected, and the logits NMSE at every target."""
    m: dict[str, float] = {}
    allh = dict(kind="all_layers", nmse_target=headline)
    for path in paths:
        achieved = [v for key, spec in specs if key["path"] == path and key["nmse_target"] == headline
                    for v in spec.achieved.values()]
        m[f"sensitivity/achieved_nmse/{path}"] = sum(achieved) / len(achieved)
        m[f"sensitivity/achieved_nmse_max_rel_error/{path}"] = max(abs(a / headline - 1) for a in achieved)
        for site in SITES:
            vals = df[(df.site == site) & (df.path == path) & _match(df, allh)].value
            m[f"sensitivity/output_nmse/{path}/{site}" if site != "kl" else f"sensitivity/kl/{path}"] = vals.mean()
    for t in sorted(df.nmse_target.unique()):
        for path in paths:
            sel = df[(df.site == "logits") & (df.path == path) & _match(df, dict(kind="all_layers", nmse_target=t))]
            m[sweep_key(t, path, "logits")] = sel.value.mean()
    return m


def _mechanism(df, m: dict) -> list[str]:
    """The content error's mechanisms (score side, value side, both; the coupling), into `m`; their table's lines
    (none when the study did not split them)."""
    if not (df.kind == "mechanism").any():
        return []
    both = m["sensitivity/output_nmse/content/logits"]
    match = df[(df.site == "logits") & _match(df, dict(kind="mechanism", side="score"))].value.mean()
    agg = df[(df.site == "logits") & _match(df, dict(kind="mechanism", side="value"))].value.mean()
    m["sensitivity/mechanism/match/logits"] = match
    m["sensitivity/mechanism/aggregation/logits"] = agg
    m["sensitivity/mechanism/both/logits"] = both
    m["sensitivity/mechanism/coupling/logits"] = both - match - agg
    return ["", "## Content error mechanisms (all layers, logits NMSE)", "",
            "| match (score side) | aggregation (value side) | both | coupling = both - match - aggregation |",
            "|---|---|---|---|", f"| {match:.3g} | {agg:.3g} | {both:.3g} | {both - match - agg:.3g} |"]


def predicted_amplification(specs, clean, layer: int) -> float:
    """Predicted score-error ratio RoPE/content at `layer`, from query energies and the injected error energies."""
    rec = clean.cache.latent_layers[layer]
    energy = {"content": [], "rope": []}
    for key, spec in specs:
        if key["kind"] == "one_layer" and key["layer"] == layer:
            energy[key["path"]].append(spec.error_energy[layer])
    e_c = torch.stack(energy["content"]).mean(0)
    e_r = torch.stack(energy["rope"]).mean(0)
    return predicted_score_error(rec.q_rope_energy, e_r) / predicted_score_error(rec.q_latent_energy, e_c)


def figures(df: pd.DataFrame, m: dict, headline: float, n_layers: int, run_dir: Path) -> None:
    def save(fig, name):
        with atomic_path(run_dir / name) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)

    if layer_key(0, "amplification/attn_output") in m:
        fig, ax = plt.subplots(figsize=(max(4, 0.6 * n_layers + 2), 3.2))
        xs = list(range(n_layers))
        nan = float("nan")  # a layer without a RoPE key has no amplification: no bar
        ax.bar(xs, [m.get(layer_key(i, "amplification/attn_output"), nan) for i in xs],
               yerr=[m.get(layer_key(i, "amplification/attn_output_std"), nan) for i in xs], capsize=3,
               label="measured (attention output)", color="tab:blue", alpha=0.8)
        ax.plot(xs, [m.get(layer_key(i, "predicted_amplification"), nan) for i in xs], "o", color="tab:red",
                label="predicted (score error)")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("MLA layer (injected alone)")
        ax.set_ylabel("amplification RoPE / content")
        ax.set_title(f"cache NMSE {headline:g}")
        ax.legend(fontsize=8)
        save(fig, "amplification_per_layer.png")

    sweep = df[(df.kind == "all_layers") & (df.site == "logits")].groupby(["path", "nmse_target"]).value
    mean, std = sweep.mean(), sweep.std(ddof=0).fillna(0)
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for path, color in (("content", "tab:blue"), ("rope", "tab:orange")):
        if path not in mean.index.get_level_values("path"):
            continue  # no RoPE key
        ax.errorbar(mean[path].index, mean[path].values, yerr=std[path].values, marker="o", color=color,
                    label=f"{path} injected", capsize=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("injected cache NMSE (all layers)")
    ax.set_ylabel("logits NMSE")
    ax.legend(fontsize=8)
    save(fig, "output_vs_injected_nmse.png")

    if (df.kind == "rope_pair").any():
        pairs = df[(df.kind == "rope_pair") & (df.site == "logits")].groupby("pair").value.mean()
        fig, ax = plt.subplots(figsize=(max(4, 0.3 * len(pairs) + 2), 3.2))
        ax.bar(pairs.index.astype(int), pairs.values, color="tab:orange")
        ax.set_xlabel("RoPE frequency pair (0 = highest frequency)")
        ax.set_ylabel("logits NMSE")
        ax.set_title(f"RoPE key error confined to one pair, cache NMSE {headline:g}")
        save(fig, "rope_pair_sensitivity.png")
