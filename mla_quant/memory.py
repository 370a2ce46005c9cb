"""Peak memory of a piece of work, on the GPU or the CPU (a side module: standard library and torch only).

    with PeakMemory("cpu") as mem:
        model(ids)
    mem.added_bytes, mem.peak_bytes, mem.seconds   # peak above the start, absolute peak, wall time
    mem.summary()                                  # {"peak_gb": ..., ...}: every run record's `memory`

On CUDA: the caching allocator's `max_memory_allocated` (tensors only, exact). On the CPU: the process's resident set
(`/proc/self/statm`) sampled every `interval` seconds by a thread while the work runs (torch releases the GIL in its
kernels); large tensors are mapped and unmapped one by one, so the resident set follows the live tensors. Where
/proc is missing, the process's lifetime peak (`ru_maxrss`), which only measures work that sets a new peak.
"""

from __future__ import annotations

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


class PeakMemory:
    """Context manager: the peak memory of the work inside it, above what was in use when it started."""

    def __init__(self, device: str | torch.device = "cpu", interval: float = 5e-4):
        self.device = torch.device(device)
        self.interval = interval
        self.start_bytes = self.peak_bytes = self.added_bytes = 0
        self.seconds = 0.0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.start_bytes = resident_bytes()
            self._peak = self.start_bytes
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, resident_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self._t0
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.seconds = time.perf_counter() - self._t0
            self._peak = max(self._peak, resident_bytes())
            self._stop.set()
            self._thread.join()
            self.peak_bytes = self._peak
        self.added_bytes = max(0, self.peak_bytes - self.start_bytes)

    def summary(self) -> dict:
        """For a run record: peak and peak added memory (GB) and what was measured (zeros before the work ran)."""
        what = "cuda_allocated" if self.device.type == "cuda" else "cpu_resident"
        return {"peak_gb": self.peak_bytes / 1e9, "peak_added_gb": self.added_bytes / 1e9, "measured": what,
                "seconds": self.seconds}
