"""Tables from the records' DataFrame (analysis.records). Each builder returns a `Table`: the rows to print (numbers
formatted, standard errors beside the scores), the numeric long form the figures use, and the records it came from.

    amplification   RoPE/content amplification per model (sensitivity runs), mean ± std over seeds, per layer
    accuracy        lm-eval score ± standard error per task, per model x method x cache format (evaluate runs)
    ruler           accuracy per context length per needle/RULER task (evaluate runs with per-length metrics)
    paired          each method against RTN (transform none) of the same format on the same examples: difference,
                    its paired standard error, examples won and lost, share of the RTN -> BF16 gap closed
                    (per-example scores from <run>/samples/, eval.log_samples)
    peers           each cache against each peer (transformers' QuantizedCache, quant=hf_*) of the same model on the
                    same examples, all tasks together and the needles both stored quantized: difference ± paired
                    standard error, won and lost, bytes of both (per quantized token and held)
    needles         needle accuracy by where the asked needle sat in the cache (quantized, protected, straddling)
    memory          bytes per token per layer, used and held, per format and context (cache_bytes runs)
    calibration     mean objective error per path without (RTN) and with each transform (calibrate runs)
    quality         perplexity and next-token KL against the unquantized cache (quality runs)
    paired_kl       each method's KL minus RTN's on the same held-out sequences, ± its standard error (quality runs'
                    per_sequence.csv)
    mixed           each quant=mixed run against the uniform option whose bytes it was given (quant.budget), same
                    model, method and protected region, on the same examples (accuracy) and sequences (KL)
    equivalence     absorbed path vs transformers, max |logit diff| per family (equivalence runs)

The newest complete record of each configuration wins; a cell no record fills stays empty (never 0). Where the paper
published the same cell (analysis/paper_results.csv), its figure stands beside ours in a `paper` column.
`python -m analysis.tables` is kept as another name for `python -m analysis`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis.records import newest_complete
from mla_quant.eval import HEADLINE_FILTERS
from mla_quant.eval.needles import REGIONS
from mla_quant.metrics import (EXAMPLES, SETTINGS, eval_key, layer_key, parse_bytes, parse_eval,
                                parse_sensitivity)
from mla_quant.quant.format import PATHS
from mla_quant.quant.formats import BASELINE
from mla_quant.quant.path import path_label, quantizer_label
from mla_quant.stats import clustered_stderr

PAPER = Path(__file__).with_name("paper_results.csv")


@dataclass
class Table:
    name: str
    title: str
    rows: pd.DataFrame  # what the markdown / LaTeX show
    long: pd.DataFrame = field(default_factory=pd.DataFrame)  # numeric, for figures
    sources: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.rows.empty


def paper_results() -> pd.DataFrame:
    return pd.read_csv(PAPER, dtype={"value": float}).fillna("")


def _newest(rows: list[dict], key: list[str]) -> pd.DataFrame:
    """One row per key: the newest record's (rows arrive oldest first)."""
    df = pd.DataFrame(rows)
    return df if df.empty else df.drop_duplicates(subset=key, keep="last").reset_index(drop=True)


def _used(df: pd.DataFrame, long: pd.DataFrame) -> list[str]:
    return sorted(set(long["source"])) if "source" in long else []


def _pm(mean, err, digits=3) -> str:
    if mean is None or pd.isna(mean):
        return ""
    return f"{mean:.{digits}f}" if err is None or pd.isna(err) else f"{mean:.{digits}f} ± {err:.{digits}f}"


# -- sensitivity -------------------------------------------------------------------------------------------------

def amplification(df: pd.DataFrame) -> Table:
    rows, per_layer, sweep = [], [], []
    paper = paper_results()
    for _, r in newest_complete(df, "sensitivity").iterrows():
        m, task = r.metrics, r.config["task"]
        if "sensitivity/amplification/logits" not in m:
            continue
        base = {"model": r.model, "noise": task.get("noise"), "cache NMSE": task.get("nmse"), "source": r.source}
        rows.append({**base, "A logits": m["sensitivity/amplification/logits"],
                     "A logits std": m.get("sensitivity/amplification/logits_std"),
                     "A KL": m.get("sensitivity/amplification/kl"), "seeds": task.get("seeds")})
        parsed = {k: parse_sensitivity(k) for k in m}
        layers = sorted({p["layer"] for p in parsed.values() if p and "layer" in p})
        for i in layers:
            per_layer.append({**base, "layer": i,
                              "measured": m.get(layer_key(i, "amplification/attn_output")),
                              "measured std": m.get(layer_key(i, "amplification/attn_output_std")),
                              "predicted": m.get(layer_key(i, "predicted_amplification"))})
        for k, v in m.items():
            p = parsed[k]
            if p and "nmse" in p and p["path"] in PATHS:
                sweep.append({**base, "injected NMSE": p["nmse"], "path": p["path"], "output NMSE": v})
    long = _newest(rows, ["model", "noise", "cache NMSE"])
    if long.empty:
        return Table("amplification", "RoPE/content amplification", long)
    keep = set(long["source"])
    pl = pd.DataFrame(per_layer)
    pl = pl[pl["source"].isin(keep)] if not pl.empty else pl
    ref = paper[(paper.table == "amplification")].set_index("model")["value"].to_dict()
    shown = pd.DataFrame({
        "model": long["model"], "noise": long["noise"], "cache NMSE": long["cache NMSE"], "seeds": long["seeds"],
        "A logits": [_pm(a, s, 2) for a, s in zip(long["A logits"], long["A logits std"])],
        "A KL": [_pm(a, None, 2) for a in long["A KL"]],
        "paper A": [ref.get(m, "") for m in long["model"]],
        "A attn output per layer": [" ".join(f"{v:.2f}" for v in pl[pl.source == s]["measured"]) if not pl.empty
                                    else "" for s in long["source"]],
        "predicted per layer": [" ".join(f"{v:.3g}" for v in pl[pl.source == s]["predicted"]) if not pl.empty
                                else "" for s in long["source"]],
    })
    if not any(shown["paper A"]):
        shown = shown.drop(columns="paper A")
    sw = pd.DataFrame(sweep)
    t = Table("amplification", "RoPE/content amplification at the logits (fixed cache NMSE)", shown, long,
              sorted(keep))
    t.per_layer = pl  # type: ignore[attr-defined]
    t.sweep = sw[sw["source"].isin(keep)] if not sw.empty else sw  # type: ignore[attr-defined]
    return t


# -- evaluation --------------------------------------------------------------------------------------------------

def _eval_base(r) -> dict:
    quant = r.config.get("quant") or {}
    cache = quant.get("name", r.quant)
    budget = None
    if "budget" in quant:  # quant=mixed: a format per layer, allocated at the bytes of quant.budget
        budget = quant["budget"]
        alloc = quant.get("allocation") or {}
        cache = f"mixed {alloc.get('by', 'sensitivity')} @{budget}"
        if (alloc.get("rope_groups") or 1) > 1:  # a width per group of RoPE pairs
            cache += f" rope/{alloc['rope_groups']}"
        content, rope = (f"per layer{quantizer_label(quant.get(path) or {})}" for path in PATHS)
        shield = quant.get("protected") or {}
        protected = f"{shield.get('n_sink', 0)}+{shield.get('recent', 0)}"
        if quant.get("mode") == "serving":
            cache = f"{cache} serving"
    elif "peer" in quant:  # transformers' QuantizedCache (conf/quant/hf_*.yaml): one format on both paths
        peer = quant["peer"]
        content = rope = f"{peer.get('library')} int{peer.get('bits')} g{peer.get('group_size')}"
        protected = f"prompt none, new < {peer.get('residual_length')}"  # transformers quantizes the whole prompt
    else:
        content, rope = path_label(quant.get("content") or {}), path_label(quant.get("rope") or {})
        shield = quant.get("protected") or {}
        protected = f"{shield.get('n_sink', 0)}+{shield.get('recent', 0)}"
        if quant.get("mode") == "serving":  # the appending step sees its own tokens fresh: another semantics
            cache = f"{cache} serving"
    data = (r.config.get("eval") or {}).get("data") or {}
    eval_set = data.get("split", "test")
    if data.get("needle_outside") is not None:  # the asked needle placed where such a cache quantizes it
        eval_set += " needle outside {}+{}".format(*data["needle_outside"])
    return {"model": r.model, "method": r["transform"] or "none", "cache": cache, "content": content, "rope": rope,
            "protected": protected, "eval set": eval_set, "peer": "peer" in quant, "budget": budget,
            "budget B": r.metrics.get("alloc/budget") if budget is not None else None,
            "B quantized": r.metrics.get("cache/bytes_per_token_per_layer"),
            "B held": r.metrics.get("cache/bf16_B_per_token_per_layer"), "source": r.source}


# Bytes per token and layer at BF16 (2 bytes per unquantized value): "B quantized" counts a token of the quantized
# region (codes, scales, zeros); "B held" is what the run's caches held on average over the lengths it evaluated
# (protected region, pending tokens, codebooks and per-sequence scales included), measured from their tensors.
EVAL_KEY = ["model", "method", "cache", "content", "rope", "protected", "eval set", "run as", "task"]


def accuracy_long(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (record, setting, task): the task's headline score and its standard error."""
    rows = []
    for _, r in newest_complete(df, "evaluate").iterrows():
        m = r.metrics
        for label in SETTINGS:
            seen = set()
            for key, value in m.items():
                k = parse_eval(key)
                if k is None or k.setting != label or not k.headline or k.task in seen:
                    continue
                seen.add(k.task)
                rows.append({**_eval_base(r), "run as": label, "task": k.task, "metric": k.metric, "score": value,
                             "stderr": m.get(k.stderr_key())})
    return _newest(rows, EVAL_KEY)


def accuracy(df: pd.DataFrame) -> Table:
    long = accuracy_long(df)
    if long.empty:
        return Table("accuracy", "Accuracy", long)
    paper = paper_results()
    paper = paper[paper.table == "accuracy"]
    long["paper"] = [next((p.value for p in paper.itertuples() if (p.model, p.method, p.cache, p.task, p.metric)
                           == (r.model, r.method, r.cache, r.task, r.metric)), None) for r in long.itertuples()]
    long["cell"] = [_pm(s, e) for s, e in zip(long["score"], long["stderr"])]
    index = ["model", "method", "cache", "content", "rope", "protected", "eval set", "run as"]
    shown = long.pivot_table(index=index, columns="task", values="cell", aggfunc="last", sort=False).reset_index()
    held = long.groupby(index, sort=False, dropna=False)[["B quantized", "B held"]].last().reset_index()
    _bytes_shown(held)  # per quantized token / held over the lengths the run evaluated (BF16)
    shown = shown.merge(held, on=index, how="left")
    shown = shown[[*index, "B quantized", "B held", *[c for c in shown.columns if c not in index
                                                       and c not in ("B quantized", "B held")]]]
    if long["paper"].notna().any():
        ref = long.dropna(subset=["paper"]).pivot_table(index=index, columns="task", values="paper", aggfunc="last")
        ref.columns = [f"paper {c}" for c in ref.columns]
        shown = shown.merge(ref.reset_index(), on=index, how="left")
    shown.columns.name = None
    return Table("accuracy", "Accuracy per task (score ± standard error)", shown.fillna(""), long,
                 _used(df, long))




def example_samples(source: str, task: str, metric: str) -> tuple[pd.Series | None, pd.Series | None]:
    """Per-example headline scores of one task of one evaluate record, from the samples file beside the record
    (<run>/samples/<task>.jsonl), and where each example's asked needle sat in the cache (quantized, protected,
    straddling, unquantized); both indexed by (doc_id, doc_hash). None for scores when the run logged no samples, for
    regions when the task has no needle regions."""
    path = Path(source).parent / "samples" / f"{task}.jsonl"
    if not path.is_file():
        return None, None
    import json

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("filter") in HEADLINE_FILTERS and metric in r.get("metrics", {})]

    def series(rs: list[dict], value, dtype) -> pd.Series | None:
        if not rs:
            return None
        index = pd.MultiIndex.from_tuples([(r["doc_id"], r.get("doc_hash")) for r in rs], names=["doc_id", "doc_hash"])
        values = pd.Series([value(r) for r in rs], index=index, dtype=dtype)
        return values[~values.index.duplicated(keep="first")]

    return (series(rows, lambda r: float(r["metrics"][metric]), float),
            series([r for r in rows if "needle" in r], lambda r: r["needle"], object))


def needle_quantized(scores: pd.Series, *regions: pd.Series | None) -> pd.Series:
    """`scores` on the examples whose asked needle every compared cache that quantizes anything stored quantized
    (a BF16 cache's "unquantized" does not count against an example); empty where a run has no needle regions."""
    keep = scores.index
    for r in regions:
        if r is None:
            return scores.iloc[:0]
        keep = keep.intersection(r.index[r.isin(["quantized", "unquantized"])])
    return scores[keep]


def _paired_row(base: dict, task: str, method: pd.Series, rtn: pd.Series, ref: pd.Series | None) -> dict | None:
    both = method.index.intersection(rtn.index)
    if len(both) < 2:
        return None
    d = method[both] - rtn[both]
    se = float(d.std(ddof=1) / len(both) ** 0.5)
    delta = float(d.mean())
    row = {**base, "task": task, "examples": len(both), "score": float(method[both].mean()),
           "RTN": float(rtn[both].mean()), "delta": delta, "paired SE": se,
           "z": delta / se if se > 0 else (0.0 if delta == 0 else math.copysign(math.inf, delta)),
           "won": int((d > 0).sum()), "lost": int((d < 0).sum()), "BF16": None, "gap closed": None}
    if ref is not None and len(both.intersection(ref.index)) == len(both):
        bf16 = float(ref[both].mean())
        row["BF16"] = bf16
        if bf16 - row["RTN"] > 0:
            row["gap closed"] = delta / (bf16 - row["RTN"])
    return row


def _with_samples(long: pd.DataFrame) -> pd.DataFrame:
    """The model rows of `accuracy_long` that logged per-example scores, with their scores and needle regions."""
    long = long[long["run as"] == "model"]
    read = [example_samples(r.source, r.task, r.metric) for r in long.itertuples()]
    long = long.assign(samples=[scores for scores, _ in read], regions=[regions for _, regions in read])
    return long[long["samples"].notna()]


def _tagged(series: pd.Series | None, task: str) -> pd.Series | None:
    """An example-indexed series with its task put into the doc_id level (to pool tasks without collisions)."""
    return None if series is None else series.rename(index=lambda i: f"{task}:{i}", level=0)


def _pooled_rows(base: dict, pooled: list) -> list[dict]:
    """Rows over every task together: all examples, and (where the runs logged needle regions) the examples whose
    asked needle every quantizing cache stored quantized. pooled: per task (method, other, reference or None,
    method regions, other regions)."""
    rows = []
    cat = [pd.concat([p[k] for p in pooled]) if all(p[k] is not None for p in pooled) else None for k in range(3)]
    if len(pooled) > 1:
        row = _paired_row({**base, "sources": []}, "all tasks", *cat)
        if row is not None:
            rows.append(row)
    subset = _needle_subset(pooled)
    if subset is not None:
        row = _paired_row({**base, "sources": []}, "needle tasks, needle quantized", *subset)
        if row is not None:
            rows.append(row)
    return rows


def _needle_subset(pooled: list) -> tuple[pd.Series, pd.Series, pd.Series | None] | None:
    """Over the tasks whose two runs both logged needle regions: the first run's scores on the examples whose asked
    needle every quantizing cache stored quantized, the other run's scores and the reference's (or None). None when
    no task has regions, or when the subset is every example of every task (the all-tasks row says it). pooled: per
    task (scores, other scores, reference scores or None, regions, other regions)."""
    flagged = [p for p in pooled if p[3] is not None and p[4] is not None]
    if not flagged:
        return None
    a = needle_quantized(pd.concat([p[0] for p in flagged]), *(pd.concat([p[k] for p in flagged]) for k in (3, 4)))
    if len(a) == sum(len(p[0]) for p in pooled):
        return None
    refs = [p[2] for p in flagged]
    return a, pd.concat([p[1] for p in flagged]), (pd.concat(refs) if all(r is not None for r in refs) else None)


def paired(df: pd.DataFrame) -> Table:
    """Each method against RTN of the same model, format, protected region and eval set, example by example: on the
    same examples the two runs' scores are paired, so the standard error of their difference, sd(d) / sqrt(n), is far
    smaller than the two unpaired standard errors combined when both runs get most examples right. Per task, over
    all tasks, and over the needle examples whose needle both caches stored quantized."""
    long = accuracy_long(df)
    if long.empty:
        return Table("paired", "Paired comparison with RTN", pd.DataFrame())
    long = _with_samples(long)
    rows = []
    group = ["model", "cache", "content", "rope", "protected", "eval set"]
    refs = long[long["cache"] == BASELINE]
    for key, g in long.groupby(group, sort=False):
        rtn = g[g["method"] == "none"]
        if rtn.empty:
            continue
        base_of = dict(zip(group, key))
        for method, m in g[g["method"] != "none"].groupby("method", sort=False):
            pooled: list = []
            base = {**base_of, "method": method, "B quantized": m["B quantized"].iloc[-1], "B held": m["B held"].mean()}
            for t in m.itertuples():
                r = rtn[rtn["task"] == t.task]
                if r.empty:
                    continue
                ref = refs[(refs["model"] == t.model) & (refs["task"] == t.task) & (refs["eval set"] == key[-1])]
                ref_s = ref["samples"].iloc[-1] if not ref.empty else None
                row = _paired_row({**base, "sources": [t.source, r["source"].iloc[-1]]},
                                  t.task, t.samples, r["samples"].iloc[-1], ref_s)
                if row is not None:
                    rows.append(row)
                    pooled.append(tuple(_tagged(x, t.task) for x in (t.samples, r["samples"].iloc[-1], ref_s,
                                                                      t.regions, r["regions"].iloc[-1])))
            rows.extend(_pooled_rows(base, pooled))
    out = pd.DataFrame(rows)
    if out.empty:
        return Table("paired", "Paired comparison with RTN", out)
    out, shown, sources = _paired_shown(out, ("score", "RTN", "BF16"))
    shown["gap closed"] = out["gap closed"].map(lambda v: "" if v is None or pd.isna(v) else f"{v:.0%}")
    return Table("paired", "Each method vs RTN on the same examples (difference ± paired standard error)", shown,
                 out, sources)


def _paired_shown(out: pd.DataFrame, scores) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """A paired comparison's rows (with `sources`, `delta`, `paired SE`, `z` columns) -> the numeric rows without
    sources, the rows to print (scores to 3 digits, delta ± paired SE, z signed) and the sources."""
    sources = sorted({s for row in out["sources"] for s in row})
    out = out.drop(columns="sources")
    shown = out.copy()
    _bytes_shown(shown)
    for c in scores:
        shown[c] = shown[c].map(lambda v: "" if v is None or pd.isna(v) else f"{v:.3f}")
    shown["delta"] = [_pm(d, e) for d, e in zip(out["delta"], out["paired SE"])]
    shown["z"] = out["z"].map(lambda v: f"{v:+.1f}")
    return out, shown.drop(columns="paired SE").rename(columns={"delta": "delta ± paired SE"}), sources


def peers(df: pd.DataFrame) -> Table:
    """Every run of the project's caches against each peer (transformers' QuantizedCache, quant=hf_*) of the same
    model and eval set, example by example on the tasks both scored, over all those tasks together and over the needle
    examples whose needle both caches stored quantized (a peer quantizes the whole prompt): the comparison with the
    cache a user would pick instead, at the bytes each holds."""
    long = accuracy_long(df)
    if long.empty or not long["peer"].any():
        return Table("peers", "Against transformers' quantized caches", pd.DataFrame())
    long = _with_samples(long)
    rows = []
    setting = ["model", "method", "cache", "content", "rope", "protected", "eval set", "B quantized"]
    for (model, peer, eval_set), p in long[long["peer"]].groupby(["model", "cache", "eval set"], sort=False):
        ours = long[(~long["peer"]) & (long["model"] == model) & (long["eval set"] == eval_set)]
        for key, g in ours.groupby(setting, sort=False, dropna=False):
            pooled = []
            for t in g.itertuples():
                other = p[p["task"] == t.task]
                if other.empty:
                    continue
                a, b = t.samples, other["samples"].iloc[-1]
                both = a.index.intersection(b.index)
                if len(both) < 2:
                    continue
                pooled.append((_tagged(a[both], t.task), _tagged(b[both], t.task), None, _tagged(t.regions, t.task),
                               _tagged(other["regions"].iloc[-1], t.task), t.source, other["source"].iloc[-1]))
            if not pooled:
                continue
            base = {**dict(zip(setting, key)), "B held": g["B held"].mean(), "peer": peer,
                    "peer protected": p["protected"].iloc[-1], "peer B quantized": p["B quantized"].iloc[-1],
                    "peer B held": p["B held"].mean(),
                    "tasks": len(pooled)}
            a, b = pd.concat([x[0] for x in pooled]), pd.concat([x[1] for x in pooled])
            subsets = [("all tasks", a, b)]
            subset = _needle_subset(pooled)
            if subset is not None:  # the pairs were taken on common examples: `q` indexes the peer's scores
                q, peer_scores, _ = subset
                subsets.append(("needle tasks, needle quantized", q, peer_scores[q.index]))
            for task, a, b in subsets:
                if len(a) < 2:
                    continue
                d = a - b
                se = float(d.std(ddof=1) / len(d) ** 0.5)
                rows.append({**base, "task": task, "examples": len(d), "score": float(a.mean()),
                             "peer score": float(b.mean()), "delta": float(d.mean()), "paired SE": se,
                             "z": float(d.mean()) / se if se > 0 else 0.0, "won": int((d > 0).sum()),
                             "lost": int((d < 0).sum()), "sources": [s for x in pooled for s in x[5:]]})
    out = pd.DataFrame(rows)
    if out.empty:
        return Table("peers", "Against transformers' quantized caches", out)
    out, shown, sources = _paired_shown(out, ("score", "peer score"))
    return Table("peers", "Each cache vs transformers' QuantizedCache on the same examples, all tasks together and "
                 "the needles both stored quantized (difference ± paired standard error; bytes per token and layer "
                 "at BF16: quantized token / held on average)", shown, out, sources)


def needles(df: pd.DataFrame) -> Table:
    """Needle accuracy by where the asked needle sat when the answer began (stored quantized, in the protected
    region, straddling both; `unquantized`: a BF16 cache), over every needle task of each evaluate run, with the
    examples in each region: how much of a score the protected window carries."""
    rows = []
    for _, r in newest_complete(df, "evaluate").iterrows():
        counts: dict[str, list[float]] = {}
        for key, value in r.metrics.items():
            k = parse_eval(key)
            if k is not None and k.setting == "model" and k.region is not None and k.metric == EXAMPLES:
                score = r.metrics.get(eval_key(k.task, "exact_match", region=k.region))
                if score is not None:
                    counts.setdefault(k.region, []).append((score * value, value))
        if not counts:
            continue
        base = {k: v for k, v in _eval_base(r).items() if k not in ("peer", "budget")}
        row = {**base, "examples": sum(n for pairs in counts.values() for _, n in pairs)}
        for region in REGIONS:
            pairs = counts.get(region)
            n = sum(c for _, c in pairs) if pairs else 0
            row[f"{region} n"] = int(n)
            row[f"{region} accuracy"] = sum(s for s, _ in pairs) / n if n else None
        rows.append(row)
    long = _newest(rows, ["model", "method", "cache", "content", "rope", "protected", "eval set"])
    if long.empty:
        return Table("needles", "Needle accuracy by where the needle sat", long)
    shown = long.drop(columns="source")
    for region in REGIONS:
        acc, n = shown.pop(f"{region} accuracy"), shown.pop(f"{region} n")
        if n.any():
            shown[f"needle {region}"] = [f"{a:.3f} ({c})" if c else "" for a, c in zip(acc, n)]
    _bytes_shown(shown)
    return Table("needles", "Needle accuracy by where the asked needle sat in the cache (accuracy (examples))",
                 shown.fillna(""), long, _used(df, long))


def ruler(df: pd.DataFrame) -> Table:
    """Per-length scores: RULER's eval/<task>/<length> and the toy needles' eval/<task>/em_<length>."""
    rows = []
    for _, r in newest_complete(df, "evaluate").iterrows():
        for key, value in r.metrics.items():
            k = parse_eval(key)
            if k is not None and k.setting == "model" and k.length is not None:
                rows.append({**_eval_base(r), "run as": "model", "task": k.task, "length": k.length,
                             "score": value})
    long = _newest(rows, [*EVAL_KEY, "length"])
    if long.empty:
        return Table("ruler", "Accuracy per context length", long)
    index = ["model", "method", "cache", "protected", "eval set", "task"]
    shown = long.pivot_table(index=index, columns="length", values="score", aggfunc="last", sort=False)
    shown = shown.map(lambda v: "" if pd.isna(v) else f"{v:.3f}").reset_index()
    shown.columns = [str(c) for c in shown.columns]
    return Table("ruler", "Accuracy per context length (tokens)", shown, long, _used(df, long))


# -- memory, calibration, quality, equivalence -------------------------------------------------------------------

def memory(df: pd.DataFrame) -> Table:
    rows = []
    for _, r in newest_complete(df, "cache_bytes").iterrows():
        per: dict = {}
        for key, value in r.metrics.items():
            parsed = parse_bytes(key)
            if parsed is not None:
                option, ctx, field = parsed
                per.setdefault((option, ctx), {})[field] = value
        for (option, ctx), v in per.items():
            rows.append({"format": option, "context": ctx, "d_c": r.config["task"].get("d_c"),
                         "used": v.get("used_bytes_per_token_per_layer"),
                         "held": v.get("held_bytes_per_token_per_layer"),
                         "formula": v.get("formula_bytes_per_token_per_layer"), "% of BF16": v.get("pct_of_bf16"),
                         "source": r.source})
    long = _newest(rows, ["format", "context", "d_c"])
    if long.empty:
        return Table("memory", "Cache bytes", long)
    shown = long.drop(columns="source").copy()
    for c in ("used", "held", "formula", "% of BF16"):
        shown[c] = shown[c].map(lambda v: "" if v is None or pd.isna(v) else f"{v:.1f}")
    return Table("memory", "Bytes per token per layer (protected region included), used and held", shown, long,
                 _used(df, long))


def calibration(df: pd.DataFrame) -> Table:
    rows = []
    for _, r in newest_complete(df, "calibrate").iterrows():
        m = r.metrics
        for path in PATHS:
            if f"calib/{path}/error" in m:
                rows.append({"model": r.model, "method": m.get("calib/transform", r["transform"]),
                             "format": m.get("calib/format", "?"), "path": path,
                             "error RTN": m[f"calib/{path}/error_none"], "error": m[f"calib/{path}/error"],
                             "seconds": m.get("calib/seconds"), "source": r.source})
    long = _newest(rows, ["model", "method", "format", "path"])
    shown = long.drop(columns="source") if not long.empty else long
    return Table("calibration", "Objective error per path (mean over layers), without and with the transform",
                 shown, long, _used(df, long))


def quality(df: pd.DataFrame) -> Table:
    rows = []
    for _, r in newest_complete(df, "quality").iterrows():
        m = r.metrics
        rows.append({**{k: v for k, v in _eval_base(r).items()}, "data": m.get("quality/source"),
                     "ppl": m.get("quality/ppl"), "ppl unquantized": m.get("quality/ppl_unquantized"),
                     "KL": m.get("quality/kl"), "KL SE": m.get("quality/kl_stderr"),
                     "top-1 agree": m.get("quality/top1_agree")})
    long = _newest(rows, ["model", "method", "cache", "content", "rope", "protected", "data"])
    shown = long.drop(columns="source") if not long.empty else long
    return Table("quality", "Perplexity and next-token KL against the unquantized cache", shown, long,
                 _used(df, long))


def paired_kl(df: pd.DataFrame) -> Table:
    """Each method's next-token KL against RTN's on the same held-out sequences (quality runs over the same data
    settings; per_sequence.csv beside each record): the difference of the token means and its standard error with
    tokens clustered by sequence (`clustered_stderr` of d_i = a method's KL sum minus RTN's on sequence i over its
    N_i tokens), and the sequences where each is lower."""
    long = quality_per_sequence(df)
    out, sources = [], set()
    if not long.empty:
        key = ["model", "cache", "content", "rope", "protected", "data", "held-out set"]
        for k, g in long.groupby(key, sort=False):
            rtn = g[g["method"] == "none"]
            if rtn.empty:
                continue
            base = rtn.iloc[-1]["per_sequence"]
            for _, r in g[g["method"] != "none"].iterrows():
                row = _kl_pair(r["per_sequence"], base, "KL RTN")
                if row is not None:
                    out.append({**dict(zip(key, k)), "method": r["method"], **_held(r, rtn.iloc[-1], "RTN"), **row})
                    sources.update([r["source"], rtn.iloc[-1]["source"]])
    long_out = pd.DataFrame(out)
    if long_out.empty:
        return Table("paired_kl", "Next-token KL vs RTN on the same sequences", long_out)
    return Table("paired_kl", "Next-token KL of each method vs RTN on the same held-out sequences",
                 _kl_shown(long_out, ("KL", "KL RTN")), long_out, sorted(sources))


def quality_per_sequence(df: pd.DataFrame) -> pd.DataFrame:
    """One row per quality configuration (the newest), with its per-sequence KL sums (per_sequence.csv)."""
    rows = []
    for _, r in newest_complete(df, "quality").iterrows():
        path = Path(r.source).parent / "per_sequence.csv"
        if path.is_file():
            data = r.config["task"].get("data") or {}
            rows.append({**_eval_base(r), "data": r.metrics.get("quality/source"),
                         "held-out set": f"{data.get('samples')} x {data.get('seq_len')} seed {data.get('seed')}",
                         "per_sequence": pd.read_csv(path).set_index("sequence")})
    return _newest(rows, ["model", "method", "cache", "content", "rope", "protected", "data", "held-out set"])


def _kl_pair(m: pd.DataFrame, base: pd.DataFrame, base_name: str) -> dict | None:
    """One run's per-sequence KL sums against another's on the sequences both scored (same token counts): the
    difference of the token means, its standard error with tokens clustered by sequence, sequences lower/higher."""
    both = m.index.intersection(base.index)
    if len(both) < 2 or not (m.loc[both, "tokens"] == base.loc[both, "tokens"]).all():
        return None
    tokens = float(base.loc[both, "tokens"].sum())
    d = m.loc[both, "kl_sum"] - base.loc[both, "kl_sum"]
    delta = float(d.sum()) / tokens
    se = clustered_stderr(d, base.loc[both, "tokens"])
    per_m = m.loc[both, "kl_sum"] / m.loc[both, "tokens"].clip(lower=1)
    per_b = base.loc[both, "kl_sum"] / base.loc[both, "tokens"].clip(lower=1)
    return {"sequences": len(both), "tokens": int(tokens), "KL": float(m.loc[both, "kl_sum"].sum()) / tokens,
            base_name: float(base.loc[both, "kl_sum"].sum()) / tokens, "delta": delta, "paired SE": se,
            "z": delta / se if se > 0 else 0.0, "sequences lower": int((per_m < per_b).sum()),
            "sequences higher": int((per_m > per_b).sum())}


def _bytes_shown(shown: pd.DataFrame) -> pd.DataFrame:
    """Every bytes column of a table to print ("B quantized", "B held", and the other run's "<name> B ...") to one
    decimal, empty where unknown; in place, returned."""
    for c in [c for c in shown.columns if c.endswith(("B quantized", "B held"))]:
        shown[c] = shown[c].map(lambda v: "" if v is None or pd.isna(v) else f"{v:.1f}")
    return shown


def _held(r, other, name: str) -> dict:
    """Bytes per token and layer of a paired row's two runs at BF16: per quantized token and held over the sequences
    scored (the other run's columns prefixed with `name`)."""
    return {"B quantized": r["B quantized"], "B held": r["B held"],
            f"{name} B quantized": other["B quantized"], f"{name} B held": other["B held"]}


def _kl_shown(long_out: pd.DataFrame, kls) -> pd.DataFrame:
    shown = _bytes_shown(long_out.copy())
    shown["delta"] = [_pm(d, e, 4) for d, e in zip(long_out["delta"], long_out["paired SE"])]
    shown["z"] = long_out["z"].map(lambda v: f"{v:+.1f}")
    for c in kls:
        shown[c] = shown[c].map(lambda v: f"{v:.4g}")
    return shown.drop(columns="paired SE").rename(columns={"delta": "delta ± paired SE"})


def mixed(df: pd.DataFrame) -> Table:
    """Each quant=mixed run against the uniform option named by its quant.budget (same model and protected region; the
    same method, or none where the option has no run with it, `_uniform`): accuracy example by example (per task and
    all tasks together, with the share of the uniform -> BF16 gap closed) and next-token KL sequence by sequence."""
    rows = []
    long = accuracy_long(df)
    if not long.empty and long["budget"].notna().any():
        long = _with_samples(long)
        refs = long[long["cache"] == BASELINE]
        group = ["model", "method", "cache", "content", "rope", "protected", "eval set"]
        for key, g in long[long["budget"].notna()].groupby(group, sort=False):
            pooled = []
            for t in g.itertuples():
                u = _uniform(long, long.loc[t.Index], (long["eval set"] == key[-1]) & (long["task"] == t.task))
                if u.empty:
                    continue
                ref = refs[(refs["model"] == t.model) & (refs["task"] == t.task) & (refs["eval set"] == key[-1])]
                ref_s = ref["samples"].iloc[-1] if not ref.empty else None
                base = {**dict(zip(group, key)), "B quantized": g.loc[t.Index, "B quantized"],
                        "B held": g.loc[t.Index, "B held"], "uniform": str(t.budget),
                        "uniform method": u["method"].iloc[-1], "uniform B quantized": u["B quantized"].iloc[-1],
                        "uniform B held": u["B held"].iloc[-1]}
                row = _paired_row({**base, "sources": [t.source, u["source"].iloc[-1]]}, t.task, t.samples,
                                  u["samples"].iloc[-1], ref_s)
                if row is not None:
                    rows.append(row)
                    pooled.append(tuple(_tagged(x, t.task) for x in (t.samples, u["samples"].iloc[-1], ref_s,
                                                                      t.regions, u["regions"].iloc[-1])))
            if pooled:
                rows.extend(_pooled_rows(base, pooled))
    kl = quality_per_sequence(df)
    if not kl.empty and kl["budget"].notna().any():
        for _, r in kl[kl["budget"].notna()].iterrows():
            u = _uniform(kl, r, (kl["data"] == r["data"]) & (kl["held-out set"] == r["held-out set"]))
            if u.empty:
                continue
            row = _kl_pair(r["per_sequence"], u.iloc[-1]["per_sequence"], "KL uniform")
            if row is not None:
                rows.append({"model": r["model"], "method": r["method"], "cache": r["cache"],
                             "protected": r["protected"], **_held(r, u.iloc[-1], "uniform"),
                             "uniform": str(r["budget"]), "uniform method": u.iloc[-1]["method"],
                             "task": f"next-token KL ({r['data']})", "sources": [r["source"], u.iloc[-1]["source"]],
                             **row})
    out = pd.DataFrame(rows)
    if out.empty:
        return Table("mixed", "Mixed precision against the uniform option at its bytes", out)
    out = out.rename(columns={"RTN": "uniform score"})
    out, shown, sources = _paired_shown(out, [c for c in ("score", "uniform score", "BF16") if c in out])
    if "gap closed" in out:
        shown["gap closed"] = out["gap closed"].map(lambda v: "" if v is None or pd.isna(v) else f"{v:.0%}")
    for c in ("KL", "KL uniform"):
        if c in out:
            shown[c] = out[c].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    return Table("mixed", "Mixed precision vs the uniform option at its bytes, on the same examples and sequences "
                 "(difference ± paired standard error; for KL lower is better)", shown.fillna(""), out, sources)


def _uniform(frame: pd.DataFrame, r, same) -> pd.DataFrame:
    """The runs of `frame` (rows where `same`) of the uniform option a mixed run `r` was given the bytes of: its
    name, the same model and protected region, its bytes per quantized token equal to the budget (so a run of that
    option with other settings, e.g. another grouping, is not taken for it), and the same method; where that option
    has no run with the method, its run without a transform (an engine's format, which no transform is fitted for:
    then the pair is the calibrated allocation against the format as the engine ships it)."""
    u = frame[same & (frame["cache"] == str(r["budget"])) & (frame["model"] == r["model"])
              & (frame["protected"] == r["protected"])]
    budget = r.get("budget B")
    u = u if budget is None or pd.isna(budget) else u[u["B quantized"] == budget]
    mine = u[u["method"] == r["method"]]
    return mine if not mine.empty else u[u["method"] == "none"]


def equivalence(df: pd.DataFrame) -> Table:
    rows = []
    for _, r in newest_complete(df, "equivalence").iterrows():
        for name in r.config["task"].get("models", []):
            key = f"equivalence/{name}/max_abs_logit_diff"
            if key in r.metrics:
                rows.append({"model": name, "max |logit diff|": f"{r.metrics[key]:.2g}",
                             "passed": r.metrics.get(f"equivalence/{name}/passed"), "source": r.source})
    long = _newest(rows, ["model"])
    shown = long.drop(columns="source") if not long.empty else long
    return Table("equivalence", "Absorbed path vs transformers' forward", shown, long, _used(df, long))


BUILDERS = (amplification, accuracy, paired, peers, needles, mixed, ruler, memory, calibration, quality, paired_kl,
            equivalence)


def main(argv=None) -> None:
    from analysis.__main__ import main as run

    run(argv)


if __name__ == "__main__":
    main()
