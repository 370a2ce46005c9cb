"""Bits per layer and path under a byte budget: the exact multiple-choice knapsack of `quant=mixed`.

    choice, cost, error = knapsack([[(cost, error), ...] per group], budget)   # least total error, cost <= budget
    path_override(2), path_override({"bits": 2, "group_size": None})   # a choice -> the path block it sets

A group is one (cache layer, path); its options are the path formats the allocation may give it, each with its bytes
per token and its predicted output error (amplification x cache NMSE at those bits, mla_quant/sensitivity/allocation.py).
The solver keeps, group by group, every (total cost, total error) point no other point beats on both (the Pareto
frontier, costs as exact fractions of the floats given): the frontier's cheapest-error point within the budget is the
optimum over every combination, not a heuristic's guess. Its size is bounded by the number of distinct cost sums.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction

UNQUANTIZED_BITS = 16  # a choice of 16 bits keeps the path unquantized (format bf16, in the activation dtype)
PROBE_BITS = 4  # a width every integer quantizer takes: a mixed option's own path settings are checked at it


def knapsack(options: Sequence[Sequence[tuple[float, float]]], budget: float) -> tuple[list[int], float, float]:
    """One option per group, total cost <= budget, least total error. options[g][k] = (cost, error), costs >= 0.
    -> (the chosen option of each group, its total cost, its total error). Ties in error go to the cheaper
    allocation, then to the earlier options. ValueError if no allocation fits the budget."""
    if not options or any(len(o) == 0 for o in options):
        raise ValueError("knapsack: every group needs at least one option")
    limit = Fraction(budget)
    frontier: list[tuple[Fraction, float, tuple[int, ...]]] = [(Fraction(0), 0.0, ())]
    for opts in options:
        merged = [(cost + Fraction(c), err + float(e), picks + (k,))
                  for cost, err, picks in frontier for k, (c, e) in enumerate(opts) if cost + Fraction(c) <= limit]
        if not merged:
            cheapest = sum(min(Fraction(c) for c, _ in o) for o in options)
            raise ValueError(f"knapsack: no allocation fits the budget {float(limit):g}; the cheapest costs "
                             f"{float(cheapest):g}")
        merged.sort(key=lambda p: (p[0], p[1], p[2]))
        frontier, best = [], float("inf")
        for point in merged:
            if point[1] < best:  # strictly better than every cheaper point: on the frontier
                frontier.append(point)
                best = point[1]
    cost, err, picks = min(frontier, key=lambda p: (p[1], p[0], p[2]))
    return list(picks), float(cost), err


def path_override(choice) -> dict:
    """One entry of `quant.choices.<path>` as the path block it puts over the option's own: a bit width (16:
    unquantized), or a mapping of path keys (e.g. {bits: 2, group_size: null}) at format int unless it says
    otherwise."""
    if isinstance(choice, Mapping):
        block = dict(choice)
        if "bits" not in block:
            raise ValueError(f"choice {block!r}: a mapping needs bits (and any other key of a path block)")
        if block["bits"] == UNQUANTIZED_BITS:
            return {"format": "bf16", "quantizer": "rtn", **block}
        return {"format": "int", **block}
    if isinstance(choice, bool) or not isinstance(choice, int):
        raise ValueError(f"choice {choice!r}: allowed a bit width (16 = unquantized) or a mapping with bits")
    if choice == UNQUANTIZED_BITS:  # unquantized: the option's integer quantizer does not apply
        return {"format": "bf16", "bits": UNQUANTIZED_BITS, "quantizer": "rtn"}
    return {"format": "int", "bits": choice}


def probe_override() -> dict:
    """The path block a mixed option's own settings (quantizer, group size, scale dtype) are checked with before any
    choice: format int at `PROBE_BITS`."""
    return path_override(PROBE_BITS)


def pairs_override(widths: Sequence[int]) -> dict:
    """The RoPE key's path block for a width per group of frequency pairs (format=pairs, 16 = unquantized)."""
    return {"format": "pairs", "bits": [int(b) for b in widths]}


def pair_group_bytes(fmt, n: int, act_bytes: int = 2) -> int:
    """Bytes per token of one group of `n` RoPE channels at `fmt.bits`, as a RoPE key with widths per group of pairs
    stores it (its own byte-stream codes, scale and zero)."""
    from mla_quant.quant.codecs import CODECS

    return CODECS["pairs"].group_bytes(fmt, fmt.bits, n, act_bytes)
