"""Peak memory of a piece of work, on the GPU or the CPU (a side module: standard library and torch only).

    with PeakMemory("cpu") as mem:
        model(ids)
    mem.added_bytes, mem.peak_bytes, mem.seconds   # peak above the start, absolute peak, wall time
    mem.added_allocated_bytes                      # peak above the start of the bytes allocated (None: unknown)
    mem.summary()                                  # {"peak_gb": ..., ...}: every run record's `memory`

    with PeakMemory("cpu") as mem, LayerProfile(mem) as layers:   # per decoder layer (profile_layers=true)
        model(ids)
    layers.summary()                               # [{"layer": 0, "calls": 1, "seconds": ..., "peak_added_gb": ...}]

    settled_resident_bytes()                       # the resident set with freed memory handed back first
    tensor_bytes(cache)                            # distinct tensor storages an object holds

On CUDA: the caching allocator's `max_memory_allocated` (tensors only, exact). On the CPU: the process's resident set
(`/proc/self/statm`) sampled every `interval` seconds by a thread while the work runs (torch releases the GIL in its
kernels); large tensors are mapped and unmapped one by one, so the resident set follows the live tensors. Where
/proc is missing, the process's lifetime peak (`ru_maxrss`), which only measures work that sets a new peak.
The resident set also keeps what the C allocator holds from freed memory (glibc raises its mmap threshold after the
first large free, so later tensors come from a heap it does not hand back), which makes small peaks noisy; beside it
the same thread samples the C allocator's bytes in use (`allocated_bytes`, glibc's `mallinfo2`: the live tensors and
other allocations, exact, whatever is kept), the CPU's counterpart of CUDA's allocated bytes.
A section (`section_start` / `section_peak`, what LayerProfile uses per layer) measures a part of the work the same
way without losing the whole's peak; on CUDA it synchronizes the device at both ends.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
import time

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """The process's resident set now (its lifetime peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc_function(name: str, restype=None):
    """A function of the C library the process runs with (glibc's, by name; looked up among the symbols already
    loaded, no library search), or None where it is missing."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    if restype is not None:
        fn.restype = restype
    return fn


_MALLINFO2 = _libc_function("mallinfo2", _MallInfo2)  # glibc 2.33 and newer
_MALLOC_TRIM = _libc_function("malloc_trim")


def allocated_bytes() -> int | None:
    """Bytes the C allocator has handed out and not taken back (heap chunks in use + mmapped chunks), from glibc's
    `mallinfo2`; None where that is missing (not glibc, or glibc < 2.33). Counts live allocations only: unlike the
    resident set, nothing the allocator keeps from freed memory."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def hand_back_freed() -> None:
    """With glibc, `malloc_trim(0)`: the heap memory freed tensors left is handed back to the system (a streamed
    model frees a layer's weights every layer; without this the resident set keeps them)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def settled_resident_bytes() -> int:
    """The resident set after garbage collection and, with glibc, `malloc_trim(0)` (freed heap memory handed back
    to the system): what live objects hold, not what the allocator kept from freed ones."""
    import gc

    gc.collect()
    if _MALLOC_TRIM is not None:  # not glibc: the resident set as it is
        _MALLOC_TRIM(0)
    return resident_bytes()


def tensor_bytes(obj, depth: int = 6) -> int:
    """Bytes of the distinct tensor storages reachable from `obj` through its attributes, dicts, lists and tuples
    (views of one storage count once): what an object such as a cache holds, measured from the tensors themselves."""
    seen: dict[int, int] = {}
    visited: set[int] = set()

    def walk(x, left):
        if torch.is_tensor(x):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
            return
        if left == 0 or id(x) in visited or isinstance(x, (str, bytes, int, float, bool, type, torch.nn.Module)):
            return
        visited.add(id(x))
        if isinstance(x, dict):
            items = x.values()
        elif isinstance(x, (list, tuple, set)):
            items = x
        elif hasattr(x, "__dict__"):
            items = vars(x).values()
        else:
            return
        for item in items:
            walk(item, left - 1)

    walk(obj, depth)
    return sum(seen.values())


class PeakMemory:
    """Context manager: the peak memory of the work inside it, above what was in use when it started."""

    def __init__(self, device: str | torch.device = "cpu", interval: float = 5e-4):
        self.device = torch.device(device)
        self.interval = interval
        self.start_bytes = self.peak_bytes = self.added_bytes = 0
        self.added_allocated_bytes: int | None = None
        self.seconds = 0.0
        self._alloc_start = self._alloc_peak = None
        self._peak = self._section_peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = self._peak = torch.cuda.memory_allocated(self.device)
        else:
            self.start_bytes = resident_bytes()
            self._peak = self.start_bytes
            self._alloc_start = self._alloc_peak = allocated_bytes()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = resident_bytes()
            self._peak, self._section_peak = max(self._peak, now), max(self._section_peak, now)
            if self._alloc_peak is not None:
                self._alloc_peak = max(self._alloc_peak, allocated_bytes())
            time.sleep(self.interval)

    def section_start(self) -> int:
        """Start measuring a part of the work: the bytes in use now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device))  # the whole's peak so far
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        self._section_peak = resident_bytes()
        return self._section_peak

    def section_peak(self) -> int:
        """The peak bytes since the last section_start."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        self._section_peak = max(self._section_peak, resident_bytes())
        return self._section_peak

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self._t0
            self.peak_bytes = max(self._peak, torch.cuda.max_memory_allocated(self.device))
        else:
            self.seconds = time.perf_counter() - self._t0
            self._peak = max(self._peak, resident_bytes())
            self._stop.set()
            self._thread.join()
            self.peak_bytes = self._peak
            if self._alloc_peak is not None:
                self.added_allocated_bytes = max(0, max(self._alloc_peak, allocated_bytes()) - self._alloc_start)
        self.added_bytes = max(0, self.peak_bytes - self.start_bytes)
        if self.device.type == "cuda":
            self.added_allocated_bytes = self.added_bytes

    def summary(self) -> dict:
        """For a run record: peak and peak added memory (GB) and what was measured (zeros before the work ran)."""
        what = "cuda_allocated" if self.device.type == "cuda" else "cpu_resident"
        out = {"peak_gb": self.peak_bytes / 1e9, "peak_added_gb": self.added_bytes / 1e9, "measured": what,
               "seconds": self.seconds}
        if self.device.type != "cuda" and self.added_allocated_bytes is not None:
            out["peak_added_allocated_gb"] = self.added_allocated_bytes / 1e9
        return out


class LayerProfile:
    """Seconds and peak added memory per decoder layer of every model that runs inside it (global module hooks; a
    decoder layer is a module whose `self_attn` has a `layer_idx`, as transformers' are), aggregated by layer index
    over calls: seconds summed, the peak added memory the largest of any call. `enabled=False`: no hooks, no rows."""

    def __init__(self, memory: PeakMemory, enabled: bool = True):
        self.memory, self.enabled = memory, enabled
        self.rows: dict[int, dict] = {}
        self._active = None  # (module, start time, start bytes) of the layer running now
        self._handles = []

    @staticmethod
    def layer_index(module) -> int | None:
        idx = getattr(getattr(module, "self_attn", None), "layer_idx", None)
        return idx if isinstance(idx, int) else None

    def _pre(self, module, args):
        if self._active is None and self.layer_index(module) is not None:
            self._active = (module, time.perf_counter(), self.memory.section_start())

    def _post(self, module, args, output):
        if self._active is None or self._active[0] is not module:
            return
        _, t0, start = self._active
        self._active = None
        peak = self.memory.section_peak()
        row = self.rows.setdefault(self.layer_index(module), {"calls": 0, "seconds": 0.0, "peak_added_bytes": 0})
        row["calls"] += 1
        row["seconds"] += time.perf_counter() - t0
        row["peak_added_bytes"] = max(row["peak_added_bytes"], peak - start)

    def __enter__(self) -> LayerProfile:
        if self.enabled:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            self._handles = [register_module_forward_pre_hook(self._pre),
                             register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._active = [], None

    def summary(self) -> list[dict]:
        return [{"layer": i, "calls": r["calls"], "seconds": r["seconds"], "peak_added_gb": r["peak_added_bytes"] / 1e9}
                for i, r in sorted(self.rows.items())]
