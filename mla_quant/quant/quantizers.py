"""Cache quantizers as small pure functions: integer group quantization (INT2/3/4/8), and the scale arithmetic every
codec shares (stored scales and zeros, groups). The functions of one codec alone live in its file under codecs/
(FP8 e4m3 in codecs/fp8.py, KIVI's per-channel blocks in codecs/channel_block.py, TurboQuant's Gaussian codebook in
codecs/codebook.py).

Everything works along the last (feature) dim of any tensor (..., d), in per-token groups of `group_size` values
(None = one group over the whole vector). Nothing here packs bits; `packing.py` does that.

Integer, asymmetric (scale + zero, zero = group minimum):     x_hat = q * s + z,              q in [0, 2^b)
Integer, symmetric   (scale only, zero point implicit):        x_hat = (q - 2^(b-1)) * s,     q in [0, 2^b)
    s = (max - min) / (2^b - 1)   or   s = amax / (2^(b-1) - 1);   q = clamp(round_half_even((x - z) / s))

Scale dtypes (`scale_dtype`): "fp16", "bf16", "fp32", and "pow2": power-of-two scales stored as int8 exponents e,
s = 2^e. Scales are rounded UP to the stored dtype (to the next power of two for pow2), so the rounded step still
covers the group's range and nothing is clipped. Codes are computed with the stored (rounded) scale and zero, so
dequantization is exact arithmetic on what is stored. The asymmetric zero is rounded to nearest in the zero dtype
(fp16 for pow2). Error per element: |x_hat - x| <= s_stored / 2 + |z_stored - min| (+ float32 arithmetic rounding);
the second term is the zero's own dtype rounding and is 0 for symmetric groups.

    codes, scales, zeros = group_quantize(x, bits=4, group_size=128)      # (..., d) uint8, (..., d/128) fp16 x2
    x_hat = group_dequantize(codes, scales, zeros, bits=4)                  # float32
    levels = fit_levels(x_calib, bits=2, group_size=64)                   # quantizer=lloyd: a codebook (4,)
    codes, scales, zeros = group_quantize(x, 2, 64, quantizer="lloyd", levels=levels)   # x_hat = levels[q] s + z
    x_hat = fake_quantize(x, bits=4, group_size=128)                        # in x.dtype
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla_quant.kernels.layout import SCALE_DTYPES, ZERO_DTYPES
from mla_quant.quant.packing import PACK_BITS

INT_BITS = PACK_BITS  # integer codes at the widths the byte stream packs
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_POW2_MIN_EXP, _POW2_MAX_EXP = -126, 127  # int8 exponent range kept inside normal float32


class Quantized(NamedTuple):
    codes: torch.Tensor  # (..., d) uint8 (integer) or float8_e4m3fn (fp8)
    scales: torch.Tensor  # (..., n_groups) in the scale dtype (int8 exponents for pow2); 0-d for per-tensor fp8
    zeros: torch.Tensor | None  # (..., n_groups) asymmetric only


# ---------------------------------------------------------------------------------------------- validation
def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in t: one sum in float64 (a NaN or inf anywhere makes it non-finite, and no sum of finite
    float32/16 values overflows it), ~10x cheaper than an elementwise isfinite on the CPU."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64)))


def check_bits(bits: int) -> None:
    if bits not in INT_BITS:
        raise ValueError(f"unsupported integer bits={bits!r}; allowed: {list(INT_BITS)}")


def check_scale_dtype(scale_dtype: str) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale_dtype={scale_dtype!r}; allowed: {list(SCALE_DTYPES)}")


def n_groups(d: int, group_size: int | None) -> int:
    """Groups per vector of d values; raises if group_size does not divide d."""
    if group_size is None:
        return 1
    if not isinstance(group_size, int) or group_size <= 0 or d % group_size:
        raise ValueError(
            f"group_size={group_size!r} does not divide the dimension {d}; allowed: null (whole vector) "
            f"or a positive divisor of {d}"
        )
    return d // group_size


def grouped(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """(..., d) -> (..., n_groups, g) view."""
    d = x.shape[-1]
    g = n_groups(d, group_size)
    return x.reshape(*x.shape[:-1], g, d // g)


# ---------------------------------------------------------------------------------------------- scale storage
def store_scale(s: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Positive float32 scales -> stored scales, rounded UP (never below s). pow2 -> int8 exponents."""
    check_scale_dtype(scale_dtype)
    s = s.float()
    if scale_dtype == "pow2":
        # ceil(log2 s) exactly, from the float's exponent: s = m 2^e with m in [0.5, 1), a power of two when m = 0.5
        m, e = torch.frexp(s)
        e = torch.where(m == 0.5, e - 1, e).clamp(_POW2_MIN_EXP, _POW2_MAX_EXP)
        return e.to(torch.int8)
    dtype = SCALE_DTYPES[scale_dtype]
    r = s.to(dtype)
    too_small = r.float() < s
    return torch.where(too_small, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


def load_scale(stored: torch.Tensor) -> torch.Tensor:
    """Stored scales -> float32 (int8 tensors are pow2 exponents)."""
    if stored.dtype == torch.int8:
        return torch.exp2(stored.float())
    return stored.float()


def round_zero(z: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    return z.to(ZERO_DTYPES[scale_dtype])


# ---------------------------------------------------------------------------------------------- integer groups
QUANTIZERS = ("rtn", "clip", "hqq", "lloyd")  # how a group's codes are chosen; the stored layout is the same
DEFAULT_QUANTIZER = QUANTIZERS[0]  # the group's min/max range, rounded to nearest
FITTED = ("lloyd",)  # levels fitted on calibration latents: a codebook per layer and path
FIT_REFERENCES = ("clip", "rtn")  # the quantizers a fitted codebook's cache NMSE is reported beside
SEARCHED = ("clip", "lloyd")  # codes chosen by a search over ranges or levels (no closed-form rounding)
STORED_BY_KERNEL = ("rtn",)  # what the store kernel rounds to: the group's min/max range
LLOYD_BITS = (2, 3, 4)  # lloyd: non-uniform levels at these widths (a codebook of 2^bits levels per layer and path)
LLOYD_ROUNDS = 3  # levels and per-group ranges fitted in turn
LLOYD_ITERS = 40  # Lloyd iterations of `fit_levels` (each lowers the fitted values' squared error, or keeps it)
LLOYD_MAX_VALUES = 1 << 21  # values `fit_levels` fits on (an even subsample of the groups beyond this)
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # clip: the group's range shrunk toward its middle, 1.0 .. 0.5
HQQ_OPTIONS = {"lp_norm": 0.7, "beta": 10.0, "kappa": 1.01, "iters": 20}  # the published defaults


def check_quantizer(quantizer: str, symmetric: bool = False, where: str = "quantizer") -> None:
    if quantizer not in QUANTIZERS:
        raise ValueError(f"{where}={quantizer!r}; allowed: {list(QUANTIZERS)}")
    if quantizer in ("hqq", "lloyd") and symmetric:
        why = "optimizes each group's zero point" if quantizer == "hqq" else "places levels inside each group's range"
        raise ValueError(f"{where}={quantizer} {why}: it needs symmetric=false")


def check_levels(levels, bits: int, where: str = "levels") -> torch.Tensor:
    """A lloyd codebook: 2^bits finite, strictly ascending levels in code units (float32 tensor)."""
    # checked where the levels are: a tuple (a format's codebook) on the host
    t = torch.as_tensor(levels, dtype=torch.float32, device=levels.device if torch.is_tensor(levels) else "cpu")
    n = 2**bits
    if t.dim() != 1 or t.numel() != n:
        raise ValueError(f"{where}: a codebook of {t.numel() if t.dim() == 1 else tuple(t.shape)} levels for "
                         f"bits={bits}; allowed: {n} levels (2^bits)")
    if not bool(torch.isfinite(t).all()) or not bool((t[1:] > t[:-1]).all()):
        raise ValueError(f"{where}: levels {t.tolist()} are not finite and strictly ascending")
    return t


def group_quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    symmetric: bool = False,
    scale_dtype: str = "fp16",
    quantizer: str = "rtn",
    levels: torch.Tensor | None = None,
) -> Quantized:
    """x (..., d) -> codes (..., d) uint8 in [0, 2^bits), scales (..., n_groups), zeros (..., n_groups) or None.

    quantizer: `rtn` (the group's min/max range), `clip` (per group, the range shrunk toward its middle by the ratio
    of CLIP_RATIOS with the least squared reconstruction error, as AWQ's clipping search), `hqq` (half-quadratic
    optimisation of each group's zero point under an l_p<1 error, Badri & Shaji's HQQ with its published defaults,
    keeping per group the best iterate by squared error). clip and hqq keep a group at least as well
    reconstructed as `rtn` (its range is one of the candidates) and stores the same codes, scales and zeros.
    `lloyd`: each code the nearest of 2^bits non-uniform `levels` (code units, ascending: x_hat = levels[q] s + z,
    `fit_levels`; fitted on x itself when None), the range searched per group among clip's at those levels."""
    check_bits(bits)
    check_scale_dtype(scale_dtype)
    check_quantizer(quantizer, symmetric)
    if levels is not None and quantizer != "lloyd":
        raise ValueError(f"levels are the codebook of quantizer=lloyd; quantizer={quantizer} takes none")
    xg = grouped(x.float(), group_size)  # (..., G, g)
    if quantizer == "lloyd":
        levels = fit_levels(x, bits, group_size, scale_dtype) if levels is None else levels
        return _lloyd_encode(x, xg, bits, scale_dtype, levels)
    if quantizer != "rtn":
        return _searched(x, xg, bits, symmetric, scale_dtype, quantizer)
    q, scales, zeros = _encode_range(xg, *_rtn_range(xg, bits, symmetric), bits, symmetric, scale_dtype)
    return Quantized(q.to(torch.uint8).reshape(x.shape), scales, zeros)


def _rtn_range(xg, bits, symmetric):
    """(start or None, step) per group (..., G): the group's min/max range (symmetric: its amax)."""
    if symmetric:
        return None, xg.abs().amax(-1) / (2 ** (bits - 1) - 1)
    lo, hi = xg.amin(-1), xg.amax(-1)
    return lo, (hi - lo) / (2**bits - 1)


def _encode_range(xg, lo, s, bits, symmetric, scale_dtype):
    """Codes, stored scales and zeros of groups xg (..., G, g) for ranges starting at lo with steps s (..., G): the
    scale rounded up to its stored dtype, codes from the stored scale and zero (the Triton store kernel's arithmetic,
    operation for operation). A zero step (an all-zero or constant group) takes step 1: every code lands on the zero
    level."""
    s = torch.where(s > 0, s, torch.ones_like(s))
    scales = store_scale(s, scale_dtype)
    step = load_scale(scales).unsqueeze(-1)
    if symmetric:
        half = 2 ** (bits - 1)
        return (torch.round(xg / step) + half).clamp(0, 2**bits - 1), scales, None
    zeros = round_zero(lo, scale_dtype)
    return torch.round((xg - zeros.float().unsqueeze(-1)) / step).clamp(0, 2**bits - 1), scales, zeros


def _decoded(q, scales, zeros, bits):
    step = load_scale(scales).unsqueeze(-1)
    return (q - 2 ** (bits - 1)) * step if zeros is None else q * step + zeros.float().unsqueeze(-1)


def _searched(x, xg, bits, symmetric, scale_dtype, quantizer) -> Quantized:
    """clip / hqq: RTN's range first, then (clip) the range shrunk toward the group's middle by each smaller ratio;
    per group the candidate with the least squared error; hqq then iterates on the zero point."""
    ranges = _clip_ranges(xg, bits, symmetric) if quantizer == "clip" else [_rtn_range(xg, bits, symmetric)]
    best = None
    for start, step in ranges:
        best = _keep_better(best, _encode_range(xg, start, step, bits, symmetric, scale_dtype), xg, bits)
    if quantizer == "hqq":
        best = _hqq(xg, best, bits, scale_dtype)
    q, scales, zeros = best[:3]
    return Quantized(q.to(torch.uint8).reshape(x.shape), scales, zeros)


def _keep_better(best, cand, xg, bits):
    err = (_decoded(cand[0], cand[1], cand[2], bits) - xg).pow(2).sum(-1)  # (..., G)
    if best is None:
        return (*cand, err)
    q, scales, zeros, best_err = best
    better = err < best_err
    q = torch.where(better.unsqueeze(-1), cand[0], q)
    scales = torch.where(better, cand[1], scales)
    zeros = None if zeros is None else torch.where(better, cand[2], zeros)
    return q, scales, zeros, torch.minimum(err, best_err)


def _hqq(xg, best, bits, scale_dtype):
    """HQQ's zero-point iterations at the RTN scale: W_q = round(x / s + z); the residual shrunk under the l_p norm,
    e = sign(r) relu(|r| - |r|^(p-1) / beta); z = mean(W_q - (x - e) / s); beta *= kappa."""
    o = HQQ_OPTIONS
    levels = 2**bits - 1
    scales = best[1]
    s = load_scale(scales).unsqueeze(-1)  # (..., G, 1): the stored step, fixed
    z = -best[2].float().unsqueeze(-1) / s  # the zero in code units
    beta = o["beta"]
    for _ in range(o["iters"]):
        q = torch.round(xg / s + z).clamp(0, levels)
        residual = xg - (q - z) * s
        mag = residual.abs().clamp_min(1e-12)
        e = torch.sign(residual) * torch.relu(mag - mag.pow(o["lp_norm"] - 1) / beta)
        z = (q - (xg - e) / s).mean(-1, keepdim=True)
        beta *= o["kappa"]
        zeros = round_zero(-(z * s).squeeze(-1), scale_dtype)
        q_stored = torch.round((xg - zeros.float().unsqueeze(-1)) / s).clamp(0, levels)
        best = _keep_better(best, (q_stored, scales, zeros), xg, bits)
    return best


def _clip_ranges(xg, bits, symmetric):
    """The candidate ranges of `clip` (and `lloyd`): RTN's, then shrunk toward the group's middle by each ratio."""
    ranges = [_rtn_range(xg, bits, symmetric)]
    if symmetric:
        amax = xg.abs().amax(-1)
        ranges += [(None, r * amax / (2 ** (bits - 1) - 1)) for r in CLIP_RATIOS[1:]]
    else:
        lo, hi = xg.amin(-1), xg.amax(-1)
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        ranges += [(mid - r * half, 2 * r * half / (2**bits - 1)) for r in CLIP_RATIOS[1:]]
    return ranges


def _lloyd_search(xg, bits, scale_dtype, levels):
    """Per group, the candidate range of `_clip_ranges` whose codes at `levels` (nearest level of each value in code
    units u = (x - z) / s) reconstruct it best: -> (codes, stored scales, zeros, u of the chosen range)."""
    edges = (levels[1:] + levels[:-1]) / 2
    best = None
    for start, step in _clip_ranges(xg, bits, False):
        _, scales, zeros = _encode_range(xg[..., :0], start, step, bits, False, scale_dtype)  # the stored range only
        s, z = load_scale(scales).unsqueeze(-1), zeros.float().unsqueeze(-1)
        u = (xg - z) / s
        q = torch.bucketize(u, edges)
        err = (levels[q] * s + z - xg).pow(2).sum(-1)
        if best is None:
            best = [q, scales, zeros, u, err]
            continue
        better = err < best[4]
        best = [torch.where(better.unsqueeze(-1), q, best[0]), torch.where(better, scales, best[1]),
                torch.where(better, zeros, best[2]), torch.where(better.unsqueeze(-1), u, best[3]),
                torch.minimum(err, best[4])]
    return best[:4]


def _lloyd_encode(x, xg, bits, scale_dtype, levels) -> Quantized:
    levels = check_levels(levels, bits).to(xg.device)
    q, scales, zeros, _ = _lloyd_search(xg, bits, scale_dtype, levels)
    return Quantized(q.to(torch.uint8).reshape(x.shape), scales, zeros)


def _lloyd(u: torch.Tensor, s: torch.Tensor, bits: int, levels: torch.Tensor) -> torch.Tensor:
    """Weighted Lloyd-Max levels of values u in code units, weights s^2 (the squared error in the data's units is
    s^2 (u - level)^2), from `levels`: alternately each value to its nearest level and each level to its values'
    weighted mean. Each step lowers the weighted squared error or keeps it. An empty cell keeps its level."""
    u, w = u.reshape(-1).double(), s.expand_as(u).reshape(-1).double().pow(2)
    if u.numel() > LLOYD_MAX_VALUES:  # an even subsample, the same every time
        idx = torch.linspace(0, u.numel() - 1, LLOYD_MAX_VALUES, device=u.device).long()
        u, w = u[idx], w[idx]
    n = levels.numel()
    levels = levels.to(u.device, torch.float64)
    for _ in range(LLOYD_ITERS):
        cell = torch.bucketize(u, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(n, dtype=torch.float64, device=u.device).index_add_(0, cell, w)
        moment = torch.zeros(n, dtype=torch.float64, device=u.device).index_add_(0, cell, w * u)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
        if torch.equal(new, levels):
            break
        levels = new
    levels = levels.float()
    for i in range(1, n):  # strictly ascending in float32 (float rounding could merge two close means)
        if levels[i] <= levels[i - 1]:
            levels[i] = torch.nextafter(levels[i - 1], torch.tensor(float("inf"), device=levels.device))
    return levels


def _fit(xg, bits, scale_dtype) -> torch.Tensor:
    """Levels and ranges fitted in turn: each group's range searched at RTN's levels 0 .. 2^bits - 1 first (that is
    `clip`), then LLOYD_ROUNDS times Lloyd's levels at the groups' current ranges and the ranges searched again at
    those levels. No step raises the squared error of the fitted values (the current range is always a candidate, and
    Lloyd's steps descend), so the codebook reconstructs them at least as well as clip, and clip as well as RTN."""
    levels = torch.arange(2**bits, dtype=torch.float32, device=xg.device)
    _, scales, _, u = _lloyd_search(xg, bits, scale_dtype, levels)
    for r in range(LLOYD_ROUNDS):
        levels = _lloyd(u, load_scale(scales).unsqueeze(-1), bits, levels)
        if r + 1 < LLOYD_ROUNDS:
            _, scales, _, u = _lloyd_search(xg, bits, scale_dtype, levels)
    return levels.cpu()


def fit_levels(x: torch.Tensor, bits: int, group_size: int | None = None, scale_dtype: str = "fp16") -> torch.Tensor:
    """The lloyd codebook of values x (..., d): 2^bits ascending levels in code units (float32, CPU) for groups of
    `group_size` stored with a range searched per group (x_hat = levels[q] s + z), fitted by Lloyd's algorithm on
    the groups' values (at most LLOYD_MAX_VALUES of them, evenly spaced) in turn with the ranges (`_fit`)."""
    if bits not in LLOYD_BITS:
        raise ValueError(f"quantizer=lloyd fits bits in {list(LLOYD_BITS)}; got bits={bits!r}")
    check_scale_dtype(scale_dtype)
    return _fit(grouped(x.detach().float(), group_size), bits, scale_dtype)


def group_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype = torch.float32,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """codes (..., d) uint8, scales/zeros (..., n_groups) -> x_hat (..., d) in `dtype`. zeros=None: symmetric.
    `levels` (2^bits,): a lloyd codebook, x_hat = levels[q] s + z (codes may also be float code values)."""
    check_bits(bits)
    d, g = codes.shape[-1], scales.shape[-1]
    if levels is not None:
        codes = levels.to(codes.device, torch.float32)[codes.long()]
    q = codes.float().reshape(*codes.shape[:-1], g, d // g)  # (..., G, g)
    s = load_scale(scales).unsqueeze(-1)
    # In place on the one new tensor: the same arithmetic, without a second large allocation (page faults dominate
    # elementwise work on a long cache).
    if zeros is None:
        x = (q - 2 ** (bits - 1)).mul_(s)
    else:
        x = (q * s).add_(zeros.float().unsqueeze(-1))
    return x.reshape(codes.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    symmetric: bool = False,
    scale_dtype: str = "fp16",
    quantizer: str = "rtn",
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize then dequantize, back in x.dtype. Values whose scales or zeros overflow the stored dtype (|x| beyond
    fp16's 65504 with scale_dtype=fp16) are refused, as the cache refuses them, instead of reading back inf.
    quantizer=lloyd: with `levels`, that codebook; without, levels fitted on x itself (`fit_levels`)."""
    if quantizer == "lloyd" and levels is None:  # fitted once here, read by the encode and the decode
        levels = fit_levels(x, bits, group_size, scale_dtype)
    codes, scales, zeros = group_quantize(x, bits, group_size, symmetric, scale_dtype, quantizer, levels)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and t.is_floating_point() and not all_finite(t):
            big = float(x.detach().abs().float().nan_to_num(posinf=float("inf")).max())
            raise ValueError(f"fake_quantize: the {name} overflow scale_dtype={scale_dtype} (max |x| = {big:.3g}"
                             f"{', or x is not finite' if not all_finite(x) else ''}); use "
                             f"scale_dtype=fp32 (or bf16) for values this large")
    return group_dequantize(codes, scales, zeros, bits, x.dtype, levels)


def group_quantize_reference(
    x: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    symmetric: bool = False,
    scale_dtype: str = "fp16",
) -> Quantized:
    """The spec of `group_quantize`: one group at a time, written out. Same signature, same results."""
    check_bits(bits)
    check_scale_dtype(scale_dtype)
    d = x.shape[-1]
    g = n_groups(d, group_size)
    size = d // g
    rows = x.float().reshape(-1, d)
    codes = torch.empty(rows.shape, dtype=torch.uint8)
    scales = torch.empty(rows.shape[0], g, dtype=SCALE_DTYPES[scale_dtype])
    zeros = None if symmetric else torch.empty(rows.shape[0], g, dtype=ZERO_DTYPES[scale_dtype])
    top = 2**bits - 1
    for r in range(rows.shape[0]):
        for j in range(g):
            v = rows[r, j * size : (j + 1) * size]
            if symmetric:
                step = v.abs().max() / (2 ** (bits - 1) - 1)
                step = step if step > 0 else torch.tensor(1.0)
                scales[r, j] = store_scale(step.reshape(1), scale_dtype)[0]
                q = torch.round(v / load_scale(scales[r, j])) + 2 ** (bits - 1)
            else:
                step = (v.max() - v.min()) / top
                step = step if step > 0 else torch.tensor(1.0)
                scales[r, j] = store_scale(step.reshape(1), scale_dtype)[0]
                zeros[r, j] = round_zero(v.min(), scale_dtype)
                q = torch.round((v - zeros[r, j].float()) / load_scale(scales[r, j]))
            codes[r, j * size : (j + 1) * size] = q.clamp(0, top).to(torch.uint8)
    lead = x.shape[:-1]
    return Quantized(
        codes.reshape(x.shape),
        scales.reshape(*lead, g),
        None if zeros is None else zeros.reshape(*lead, g),
    )
