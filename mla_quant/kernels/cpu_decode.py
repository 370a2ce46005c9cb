"""Fused CPU decode attention over a (quantized) paged latent cache, in C++: one query token per sequence.

    o_latent = latent_decode_cpu(q_latent, q_rope, scale, segments)   # (B, H, d_c) float32, CPU tensors
    why = cpu_kernel_unavailable()                                    # None, or why it cannot run here

The CPU counterpart of the Triton kernel (mla_quant/kernels/latent_decode.py), with its signature and its arguments
(`Segment`s: per path a `PagedPath` of int32 code words with scales, zeros and an optional codebook, float values,
the engines' e4m3 / e2m1 byte codes with their scales, or a stream of 3- or 4-bit codebook indices;
a block table and tokens per sequence; kernels/layout.py), checked by the same `check_inputs`, and the arithmetic of
its PyTorch reference `latent_decode_reference`. In one pass over the pages, a tile of 32 tokens at a time, it
unpacks each token's codes, dequantizes them per group, scores them against every head's query and accumulates the
values under an online softmax; each sequence's tokens are split into chunks over the threads (`at::parallel_for`)
and merged with log-sum-exp weights. Nothing is decoded beyond one tile per thread, and a step is one call instead
of the few hundred small tensor operations of `segment_attention` (mla_quant/kernels/attention.py), which is what
a decode step over a small model spends its time on.

The source (csrc/latent_decode_cpu.cpp) is compiled on first use with `torch.utils.cpp_extension.load` (about 10 s
on 2 cores, once per machine and environment: the build is cached under TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions, in a folder named by the Python and torch versions and the instruction set), for the
instruction set this CPU has (x86-64 with AVX2, FMA and F16C: those; otherwise the compiler's default), with OpenMP,
and registered as the operator `torch.ops.mla_quant_cpu.latent_decode`. Paths of several widths (the RoPE key's
format=pairs) are not read: the PyTorch path decodes those.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
import time
import warnings
from pathlib import Path

import torch

from mla_quant.kernels.layout import CODES, SCALE_KINDS, check_inputs, in_bases

SOURCE = Path(__file__).parent / "csrc" / "latent_decode_cpu.cpp"
X86_FLAGS = ("avx2", "fma", "f16c")  # the instruction set extensions the x86-64 build is compiled for, when present


def _isa() -> tuple[str, list[str]]:
    """(a tag naming the build, its compiler flags) for this CPU: a build's name carries its instruction set, so
    machines sharing one extension cache (a cluster's home directory) never load one built for another CPU."""
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split()
        except (OSError, StopIteration):
            flags = []
        if all(f in flags for f in X86_FLAGS):
            return "avx2", [f"-m{f}" for f in X86_FLAGS]
    return platform.machine().lower() or "cpu", []


STALE_LOCK_S = 600  # a build lock older than this was left by a build that was killed: it is removed


def _build_name() -> tuple[str, list[str]]:
    """(the build's name, its instruction-set flags): the name carries the Python and torch versions and the
    instruction set, so a cache shared by machines or environments never loads a build made for another."""
    tag, flags = _isa()
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{tag}"
    return "mla_quant_cpu_decode_" + re.sub(r"[^0-9A-Za-z]", "_", version), flags


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str | None]:
    """(the operator, None) once built and loaded, or (None, why not)."""
    name, flags = _build_name()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    build = root / name
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # torch's build lock: a killed build leaves it, and every later build would wait on it
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            warnings.warn(f"removing a stale build lock of the C++ decode kernel: {lock}", stacklevel=2)
            lock.unlink(missing_ok=True)
        # -fopenmp: at::parallel_for is inline OpenMP (ATen's parallel backend); the process's libgomp is torch's
        load(name=name, sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
             build_directory=str(build), is_python_module=False, verbose=False)
        # the operator's fake implementation (its output's shape and dtype): a decode step traces under
        # FakeTensorMode and torch.compile (kernels/ops.py)
        try:
            torch.library.register_fake("mla_quant_cpu::latent_decode")(
                lambda q_latent, q_rope, scale, tensors, meta: (
                    q_latent.new_empty(q_latent.shape, dtype=torch.float32),
                    q_latent.new_empty(q_latent.shape[:2], dtype=torch.float32)))
        except RuntimeError:  # registered by an earlier load in this process
            pass
        return torch.ops.mla_quant_cpu.latent_decode, None
    except Exception as err:  # no compiler, no ninja, a failed build: the reason, for the caller to report
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        return None, f"{type(err).__name__}: {' '.join(lines[-3:])[-400:]}"


def cpu_kernel_unavailable() -> str | None:
    """None when the C++ decode kernel is built and loaded here (building it on the first call), else why not."""
    return _load()[1]


def require_cpu_kernel(what: str = "quant.backend=cpu", hint: str = ""):
    """The operator, or a RuntimeError naming `what` and why the kernel cannot run here."""
    op, why = _load()
    if op is None:
        raise RuntimeError(f"{what} cannot run: the C++ decode kernel ({SOURCE.name}) did not build here ({why}); "
                           f"it needs a C++ compiler and ninja{hint}")
    return op


def _path_tensors(p) -> tuple[list, list[int]]:
    """A path's 4 tensors and 5 ints: bits, group, symmetric, codes (`layout.CODES`), what uint8 scales are (0: the
    scales' dtype says; E8M0 or e4m3 bytes: their index in `layout.SCALE_KINDS`)."""
    if p.bits == 0:
        return [p.data, None, None, None], [0, 1, 1, 0, 0]
    scale_bytes = SCALE_KINDS.index(p.scales_as) if p.scales_as in ("e8m0", "e4m3") else 0
    return ([p.data, p.scales, None if p.symmetric or p.codes != "words" else p.zeros, p.levels],
            [int(p.bits), int(p.group), int(bool(p.symmetric)), CODES.index(p.codes), scale_bytes])


def latent_decode_cpu(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float, segments,
                      return_lse: bool = False):
    """The fused CPU kernel (see the module docstring): q_latent (B, H, d_c), q_rope (B, H, d_r), segments (a list of
    `Segment`) -> o_latent (B, H, d_c) float32 (with return_lse, also its log-sum-exp (B, H)). Paths in a rotated
    basis are read against the rotated query (`in_bases`). Arguments are checked before the call; errors name
    them."""
    check_inputs(q_latent, q_rope, segments)
    if q_latent.device.type != "cpu":
        raise ValueError(f"latent_decode_cpu reads CPU tensors; q_latent is on {q_latent.device} (on a GPU the "
                         f"Triton kernel, latent_decode, reads these segments)")
    for i, seg in enumerate(segments):
        if seg.rope.pairs is not None:
            raise ValueError(f"segments[{i}].rope: a path of several widths (format=pairs) is not read by the CPU "
                             f"kernel; allowed: float values or int codes of one width (the PyTorch path, "
                             f"segment_attention, reads it)")
    # traced (torch.compile): the operator by name, loaded when the step's backend was chosen (a build is no graph's)
    op = torch.ops.mla_quant_cpu.latent_decode if torch.compiler.is_compiling() else \
        require_cpu_kernel("latent_decode_cpu")
    return in_bases(q_latent.float(), q_rope.float(), segments,
                    lambda ql, qr, segs: op(ql, qr, float(scale), *operator_arguments(segs)), return_lse)


def operator_arguments(segments) -> tuple[list, list[int]]:
    """The operator's (tensors, meta) for `segments`: per segment and path 4 tensors and 5 ints, then its block
    table and lengths."""
    tensors, meta = [], []
    for seg in segments:
        for p in (seg.content, seg.rope):
            t, m = _path_tensors(p)
            tensors += t
            meta += m
        tensors += [seg.block_table, seg.lengths]
    return tensors, meta
