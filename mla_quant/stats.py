"""Statistics shared by the stages and the analysis (numpy only, so any layer and `analysis/` may import it)."""

from __future__ import annotations

import numpy as np


def clustered_stderr(sums, counts) -> float:
    """Standard error of a mean over tokens, sum(S) / sum(N), when tokens come in clusters (sequences) that are not
    independent: the ratio estimator's sqrt(n / (n - 1) * sum_i (S_i - m N_i)^2) / sum_i N_i over the n clusters, with
    S_i a cluster's sum, N_i its token count and m = sum(S) / sum(N). For a paired difference, S_i is the difference
    of two runs' sums over the same tokens. NaN with fewer than two clusters."""
    s, c = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    n = len(s)
    if n < 2:
        return float("nan")
    m = s.sum() / c.sum()
    return float(np.sqrt(n / (n - 1) * ((s - m * c) ** 2).sum()) / c.sum())
