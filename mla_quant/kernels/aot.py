"""Ahead-of-time compilation of the Triton kernels for a named GPU, on a machine without one.

    with ahead_of_time(arch=90):                       # sm_90 (Hopper); 80 = Ampere, 100 = Blackwell
        latent_decode(q, qr, scale, segments)          # CPU tensors: compiles stage 1 and the merge, launches nothing
    rows = compiled_kernels()                          # per kernel: registers, spills, stack, shared memory

Inside the context the Triton runtime sees a GPU of the named architecture: every launch of the project's kernels
compiles for it (PTX -> cubin through Triton's own ptxas) and returns without running; `resources` reads the
cubin's registers, stack, spill stores/loads and shared memory with the `cuobjdump --dump-resource-usage` that
Triton ships. The arguments keep the shapes, dtypes, alignments and constexprs of a real launch, so the kernel
compiled is the one a GPU would build for that call.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

ARCHS = {80: "Ampere (A100)", 90: "Hopper (H100/H200)", 100: "Blackwell (B200)"}
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}  # bytes of shared memory one block may use
REGISTERS_PER_SM = 65536


def jit_kernels() -> dict:
    """The project's launchable Triton kernels by name."""
    from mla_quant.kernels import latent_decode, quant_store

    return {"decode_stage1": latent_decode._stage1_kernel, "decode_merge": latent_decode._merge_kernel,
            "quant_store": quant_store._quantize_append_kernel}


class _TargetDriver:
    """What the JIT runtime asks of the active driver before it compiles, answered for a named target."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)
        self.device = f"aot-sm_{arch}"

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def ahead_of_time(arch: int = 90) -> Iterator[None]:
    """Compile, never launch: the project's kernels build for sm_`arch` at each launch inside the context."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch}; allowed: {sorted(ARCHS)} ({', '.join(f'{a}: {n}' for a, n in ARCHS.items())})")
    from mla_quant.kernels import latent_decode

    kernels = jit_kernels()
    if not all(hasattr(fn, "device_caches") for fn in kernels.values()):
        raise RuntimeError("ahead-of-time compilation needs the kernels imported without TRITON_INTERPRET=1 (the "
                           "interpreter compiles nothing)")
    previous = driver._active
    latent_decode.COMPILE_ONLY.append(arch)
    driver.set_active(_TargetDriver(arch))
    for fn in kernels.values():  # fn[grid](...) calls fn.run(grid=..., warmup=False): compile only
        fn.run = _compile_only(type(fn).run.__get__(fn))
    try:
        yield
    finally:
        for fn in kernels.values():
            del fn.run
        driver._active = previous
        latent_decode.COMPILE_ONLY.pop()


def _compile_only(run):
    def compile_only(*args, grid, warmup, **kwargs):
        return run(*args, grid=grid, warmup=True, **kwargs)

    return compile_only


def compiled(arch: int = 90) -> list[tuple[str, object]]:
    """(kernel name, compiled kernel) for every kernel compiled for sm_`arch` so far in this process."""
    out = []
    for name, fn in jit_kernels().items():
        caches = fn.device_caches.get(f"aot-sm_{arch}")
        for kernel in (caches[0].values() if caches else ()):
            out.append((name, kernel.result() if hasattr(kernel, "result") else kernel))
    return out


def kernel_row(kernel, arch: int) -> dict:
    """A compiled kernel's warps, stages, shared memory, the cubin's resources (`resources`) and its blocks per SM."""
    meta = kernel.metadata
    row = {"warps": meta.num_warps, "stages": meta.num_stages, "shared_B": meta.shared,
           **resources(kernel.asm["cubin"]),
           "mma_ops": len(re.findall(r"\b(?:wgmma|mma)\.", kernel.asm["ptx"]))}  # tensor-core instructions
    row["blocks_per_sm"] = occupancy(row, arch)
    row["shared_ok"] = meta.shared <= SHARED_LIMIT[arch]
    return row


def compiled_kernels(arch: int = 90) -> list[dict]:
    """`kernel_row` of every kernel compiled for sm_`arch` so far in this process, with its name and target."""
    return [{"kernel": name, "arch": f"sm_{arch}", **kernel_row(kernel, arch)} for name, kernel in compiled(arch)]


def cuobjdump() -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"Triton {triton.__version__} ships no cuobjdump at {path}")
    return str(path)


def resources(cubin: bytes) -> dict:
    """REG, STACK, SHARED, LOCAL (spilled bytes per thread) of a cubin, from `cuobjdump --dump-resource-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in found:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[:300]!r}")
    return {"regs": int(found["REG"]), "stack_B": int(found.get("STACK", 0)),
            "static_shared_B": int(found.get("SHARED", 0)), "spill_B": int(found.get("LOCAL", 0))}


def occupancy(row: dict, arch: int) -> int:
    """Blocks of this kernel one SM holds at once, by registers and by shared memory (the smaller)."""
    threads = 32 * row["warps"]
    by_regs = REGISTERS_PER_SM // max(1, row["regs"] * threads)
    by_shared = SHARED_LIMIT[arch] // row["shared_B"] if row["shared_B"] else 32
    return int(min(by_regs, by_shared, 2048 // threads))
