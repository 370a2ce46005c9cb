"""The RoPE key's frequency pairs, defined once: which two channels of a d_r-dim key form pair i in each layout.
The families (their cached key's layout), the transforms (the pair rotation), the sensitivity study (per-pair
injection) and the pairs codec (bits per group of pairs) read it from here."""

from __future__ import annotations

PAIR_LAYOUTS = ("half", "interleaved")  # pair i is (i, i + d_r/2) (rotate-half order) or (2i, 2i + 1)


def rope_pair(layout: str, d_r: int, i: int) -> tuple[int, int]:
    """The two coordinates of RoPE frequency pair i in a d_r-dim key laid out as `layout`."""
    if not 0 <= i < d_r // 2:
        raise ValueError(f"RoPE pair {i} out of range: d_r={d_r} has pairs 0..{d_r // 2 - 1}")
    if layout == "interleaved":
        return 2 * i, 2 * i + 1
    if layout == "half":
        return i, i + d_r // 2
    raise ValueError(f"unknown RoPE layout {layout!r}; allowed: {', '.join(sorted(PAIR_LAYOUTS, reverse=True))}")
