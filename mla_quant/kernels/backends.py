"""The decode backends: which kernel reads the packed cache in one-token decode steps, registered once.

    quant.backend=auto     the first registered kernel that runs on the step's device, reads the format and is
                           usable here (Triton on a CUDA device, the C++ kernel on the CPU), else PyTorch
    quant.backend=<name>   that kernel for every decode step (refused by name where it cannot read the format)
    quant.backend=torch    the PyTorch path (`TORCH`, not a kernel: it reads every format)

A backend is a `DecodeBackend`: the devices whose tensors it reads, why it cannot read a format (asked of the format,
which knows its codecs), why it cannot run here, its operator (kernels/ops.py, loaded on first use) and whether its
store kernel writes new tokens into the pages. Adding a kernel is one entry here; the format (`CacheFormat`), the
cache layer (cache/kernel.py) and the preparation step read the registry, never a backend's name.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

TORCH = "torch"  # the PyTorch path: every format, every device, every step type


def _triton_unavailable() -> str | None:
    """(Asked for CUDA tensors only, so a GPU is there.)"""
    import importlib.util

    return None if importlib.util.find_spec("triton") is not None else "Triton is not installed"


def _require_triton(what: str, hint: str) -> None:
    from mla_quant.kernels.latent_decode import require_triton

    require_triton(what, hint)


def _require_cpu(what: str, hint: str) -> None:
    from mla_quant.kernels.cpu_decode import require_cpu_kernel

    require_cpu_kernel(what, hint)


def _cpu_unavailable() -> str | None:
    from mla_quant.kernels.cpu_decode import cpu_kernel_unavailable

    return cpu_kernel_unavailable()


def _op(name: str):
    from mla_quant.kernels.ops import decode_op

    return decode_op(name)


@dataclass(frozen=True)
class DecodeBackend:
    name: str
    devices: tuple[str, ...]  # device types whose tensors its decode steps read
    unsupported: Callable  # format -> why this kernel cannot read it (naming the setting), or None
    reads: str  # what it reads, for a refusal
    unavailable: Callable[[], str | None]  # why it cannot run here (checked once, building it if need be)
    require: Callable[[str, str], None]  # raise, naming the setting and why, unless it can run here
    device_hint: str  # what to use instead, for a step on a device it does not read
    stores: bool = False  # its own store kernel quantizes new tokens into the pages (else the PyTorch encoder)
    sinks: bool = False  # reads attention sinks
    interpreter: str | None = None  # an environment variable that, set to 1 before starting, runs it on any device

    def op(self):
        """The kernel: (q_latent, q_rope, scale, segments) -> output, through its PyTorch operator."""
        return _op(self.name)

    def runs_on(self, device_type: str) -> bool:
        return device_type in self.devices or bool(self.interpreter and os.environ.get(self.interpreter) == "1")

    def usable(self) -> bool:
        return _usable(self.name)


def _int_bits() -> list[int]:
    from mla_quant.kernels.layout import WORD_BITS

    return list(WORD_BITS)


DECODE_BACKENDS: dict[str, DecodeBackend] = {
    b.name: b for b in (
        DecodeBackend("triton", ("cuda",), lambda fmt: fmt.kernel_unsupported(),
                      f"bf16 paths, int with bits {_int_bits()}, widths per group of RoPE pairs, or the engines' e4m3 "
                      f"and e2m1 codes",
                      _triton_unavailable, _require_triton,
                      "use quant.backend=auto, or cpu for the C++ kernel; TRITON_INTERPRET=1 before starting runs "
                      "the Triton kernel in its CPU interpreter", stores=True, interpreter="TRITON_INTERPRET"),
        DecodeBackend("cpu", ("cpu",), lambda fmt: fmt.cpu_kernel_unsupported(),
                      f"bf16 paths, int with bits {_int_bits()} (one width per path), or the engines' e4m3 and e2m1 "
                      f"codes",
                      _cpu_unavailable, _require_cpu, "use quant.backend=auto or triton on a GPU"),
    )
}


@functools.lru_cache(maxsize=None)
def _usable(name: str) -> bool:
    """True when backend `name` runs here (checked once); otherwise a warning says why, and backend=auto decodes in
    PyTorch on the devices it would have read."""
    why = DECODE_BACKENDS[name].unavailable()
    if why is not None:
        warnings.warn(f"the {name} decode kernel is unavailable ({why}); quant.backend=auto decodes "
                      f"{'/'.join(DECODE_BACKENDS[name].devices)} tensors in PyTorch", stacklevel=3)
    return why is None


def decode_backend(fmt, device_type: str) -> str:
    """The backend of `fmt`'s decode steps on a device of `device_type`: the one it names, or with backend=auto the
    first registered kernel that reads the device's tensors and the format and can run here, else PyTorch."""
    if fmt.backend != "auto":
        return fmt.backend
    for b in DECODE_BACKENDS.values():
        if device_type in b.devices and b.unsupported(fmt) is None and b.usable():
            return b.name
    return TORCH
