"""Figures from the tables' numeric long forms (analysis.tables). Each returns {name: (matplotlib Figure, sources)}.

Log axes where values span more than a decade (the toy's predicted per-layer amplification, ~1000, beside measured
values <= 34); titles name the model and the settings; the paper's published figure, where the same cell exists, is
drawn as a hollow marker.
"""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.tables import Table, paper_results  # noqa: E402


LINES = ("-", "--", ":", "-.")


def _legend_right(ax) -> None:
    """The legend beside the axes (figures are saved with a tight bounding box, so it stays in the image)."""
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _spans_decades(values) -> bool:
    v = np.asarray([x for x in values if x is not None and not pd.isna(x) and x > 0], dtype=float)
    return len(v) > 1 and v.max() / v.min() > 10


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in str(text))


def amplification_figures(t: Table) -> dict:
    out: dict = {}
    if t.empty:
        return out
    long = t.long
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(long), 3.6))
    labels = [f"{m}\n{n}, {c:g}" for m, n, c in zip(long["model"], long["noise"], long["cache NMSE"])]
    x = np.arange(len(long))
    ax.bar(x, long["A logits"], yerr=long["A logits std"].fillna(0), capsize=3, color="#4c72b0", label="measured")
    ref = paper_results()
    ref = ref[ref.table == "amplification"].set_index("model")["value"]
    px = [(i, ref[m]) for i, m in enumerate(long["model"]) if m in ref]
    if px:
        ax.scatter(*zip(*px), marker="o", facecolors="none", edgecolors="k", zorder=3, label="paper")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("RoPE / content output NMSE (logits)")
    if _spans_decades(list(long["A logits"]) + [v for _, v in px]):
        ax.set_yscale("log")
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.set_title("Amplification of the RoPE key over the content latent\nat equal cache NMSE, per model", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out["amplification_by_model"] = (fig, list(long["source"]))

    pl = getattr(t, "per_layer", pd.DataFrame())
    for (model, noise, nmse, source), g in (pl.groupby(["model", "noise", "cache NMSE", "source"], sort=False)
                                            if not pl.empty else []):
        fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(g) + 2), 3.4))
        x = np.arange(len(g))
        ax.bar(x - 0.2, g["measured"], 0.4, yerr=g["measured std"].fillna(0), capsize=2, label="measured")
        if g["predicted"].notna().any():
            ax.bar(x + 0.2, g["predicted"], 0.4, label="predicted (analytical)", color="#dd8452")
        ax.set_xticks(x, [str(i) for i in g["layer"]])
        ax.set_xlabel("layer (error injected into this layer only)")
        ax.set_ylabel("amplification at the attention output")
        if _spans_decades(list(g["measured"]) + list(g["predicted"])):
            ax.set_yscale("log")
        ax.set_title(f"{model}: per-layer amplification\n({noise} noise, cache NMSE {nmse:g})", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out[f"amplification_per_layer_{_slug(model)}_{_slug(noise)}"] = (fig, [source])

    sw = getattr(t, "sweep", pd.DataFrame())
    if not sw.empty:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for (model, path), g in sw.groupby(["model", "path"], sort=False):
            g = g.sort_values("injected NMSE")
            ax.plot(g["injected NMSE"], g["output NMSE"], marker="o", ls="-" if path == "rope" else "--",
                    label=f"{model} {path}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("injected cache NMSE")
        ax.set_ylabel("output NMSE (logits)")
        ax.set_title("Output vs injected NMSE, content latent vs RoPE key", fontsize=9)
        _legend_right(ax)
        fig.tight_layout()
        out["output_vs_injected_nmse"] = (fig, sorted(set(sw["source"])))
    return out


def ruler_figures(t: Table) -> dict:
    out: dict = {}
    if t.empty:
        return out
    for model, g in t.long.groupby("model", sort=False):
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        methods = list(dict.fromkeys(g["method"]))
        settings = list(dict.fromkeys(zip(g["cache"], g["protected"])))
        for (method, cache, protected), h in g.groupby(["method", "cache", "protected"], sort=False):
            mean = h.groupby("length")["score"].mean()
            ax.plot(mean.index, mean.values, marker="o", color=f"C{methods.index(method) % 10}",
                    ls=LINES[settings.index((cache, protected)) % len(LINES)],
                    label=f"{method} / {cache} / protected {protected}")
        ax.set_xscale("log", base=2)
        lengths = sorted(g["length"].unique())
        ax.set_xticks(lengths, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (mean over tasks)")
        tasks = ", ".join(sorted(g["task"].unique()))
        ax.set_title(f"{model}: accuracy vs context length\n{textwrap.fill(tasks, 70)}", fontsize=8)
        _legend_right(ax)
        fig.tight_layout()
        out[f"ruler_accuracy_vs_length_{_slug(model)}"] = (fig, sorted(set(g["source"])))
    return out


def memory_figures(t: Table) -> dict:
    if t.empty:
        return {}
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for fmt, g in t.long.groupby("format", sort=False):
        g = g.sort_values("context")
        (line,) = ax.plot(g["context"], g["used"], marker="o", label=f"{fmt} used")
        ax.plot(g["context"], g["held"], ls="--", color=line.get_color(), label=f"{fmt} held")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("bytes per token per layer")
    dims = ", ".join(f"d_c={d}" for d in sorted(t.long["d_c"].dropna().unique()))
    ax.set_title(f"Cache bytes per token vs context ({dims}; protected region included)", fontsize=9)
    _legend_right(ax)
    fig.tight_layout()
    return {"memory_bytes_vs_context": (fig, sorted(set(t.long["source"])))}


def accuracy_vs_bytes(t: Table) -> dict:
    if t.empty:
        return {}
    long = t.long[(t.long["run as"] == "model") & t.long["B held"].notna()]
    if "eval set" in long:  # the reported sets only: a development split's runs are choices, not results
        long = long[~long["eval set"].astype(str).str.startswith("dev")]
    if long.empty:
        return {}
    key = ["model", "method", "cache", "protected", "B held"]
    mean = long.groupby(key, sort=False)["score"].mean().reset_index()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    markers = dict(zip(mean["model"].unique(), "osD^v<>"))
    for (method, model), g in mean.groupby(["method", "model"], sort=False):
        ax.scatter(g["B held"], g["score"], marker=markers[model], label=f"{method} ({model})")
        for r in g.itertuples():
            ax.annotate(f"{r.cache} {r.protected}", (r._5, r.score), fontsize=5, xytext=(2, 2),
                        textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache bytes held per token per layer (BF16 values; protected region included)")
    ax.set_ylabel("accuracy (mean over tasks)")
    ax.set_title("Accuracy vs cache bytes held, every method and format (test sets)", fontsize=9)
    _legend_right(ax)
    fig.tight_layout()
    return {"accuracy_vs_bytes": (fig, sorted(set(long["source"])))}
