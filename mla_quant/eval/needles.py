"""Where each needle sits in the cache: stored quantized, in the protected region, or across both.

A needle document carries `length` (the prompt's tokens) and `needle_tokens` ([first, end) of each needle's value
among the prompt's tokens, the asked one first; `mla_quant.tasks.niah`). The cache format says which positions of a
prompt it holds quantized (`quantized_positions`), so each example gets the region of the asked value when the first
answer token is generated:

    quantized    every token of the value is stored quantized
    protected    every token is in the sinks, the recent window or a block not yet full (full precision)
    straddling   some of each
    unquantized  the cache quantizes nothing (BF16)

    region = needle_region(doc, fmt)                  # per example, into samples/<task>.jsonl as "needle"
    metrics = region_metrics(rows)                    # exact_match and examples per region
"""

from __future__ import annotations

from collections.abc import Iterable

from mla_quant.eval import HEADLINE_FILTERS
from mla_quant.metrics import EXAMPLES, needle_metric

REGIONS = ("quantized", "protected", "straddling", "unquantized")  # every region `needle_region` names


def needle_region(doc: dict, fmt) -> str | None:
    """The region of the asked needle's value of `doc` in a cache of format `fmt` (None: a BF16 cache); None for a
    document without needles."""
    spans = doc.get("needle_tokens")
    if not spans:
        return None
    if fmt is None or not fmt.quantized:
        return "unquantized"
    first, end = spans[0]
    start, stop = fmt.quantized_positions(int(doc["length"]))
    if start <= first and end <= stop:
        return "quantized"
    if end <= start or first >= stop:
        return "protected"
    return "straddling"


def check_placement(needle_outside, fmt) -> None:
    """Refuse eval.data.needle_outside=[n_sink, recent] with a quantized cache that protects more: its needles would
    not be where that cache quantizes them."""
    if needle_outside is None or fmt is None or not getattr(fmt, "quantized", True):
        return
    n_sink, recent = (int(x) for x in needle_outside)
    held = (getattr(fmt, "n_sink", 0), getattr(fmt, "recent", 0))
    if held[0] > n_sink or held[1] > recent:
        raise ValueError(f"eval.data.needle_outside=[{n_sink},{recent}] places needles clear of the first {n_sink} and "
                         f"last {recent} tokens, but quant={fmt.name} protects {held[0]} sinks and {held[1]} recent "
                         f"tokens; set eval.data.needle_outside=[{max(held[0], n_sink)},{max(held[1], recent)}] (the "
                         f"same for every run compared) or quant.protected to at most those")


def region_metrics(rows: Iterable[dict], metric: str = "exact_match") -> dict[str, float]:
    """{needle_<region>/<metric>: mean, needle_<region>/examples: count} over compact sample rows that carry a
    "needle" region (one row per example and filter: the headline filter's rows only)."""
    by: dict[str, list[float]] = {}
    for row in rows:
        region = row.get("needle")
        if region is None or row.get("filter") not in HEADLINE_FILTERS or metric not in row["metrics"]:
            continue
        by.setdefault(region, []).append(float(row["metrics"][metric]))
    out = {}
    for region, values in by.items():
        out[needle_metric(region, metric)] = sum(values) / len(values)
        out[needle_metric(region, EXAMPLES)] = float(len(values))
    return out
