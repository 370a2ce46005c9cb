"""Audits of the model's work for the faults a first GPU run meets, run on any machine.

Host reads: device values read on the host while the model works (`.item()`, `int()`/`bool()` of a tensor,
`nonzero`, `tolist()`, a copy of a CUDA tensor to the CPU). On a GPU each is a stream synchronisation, and CUDA graph
capture refuses them; counted here on any device, with the project's function that made each read.

    with HostReads() as reads:
        model(input_ids=tok, attention_mask=mask, past_key_values=cache)
    reads.count, reads.sites           # Counter of (op, "module.py:function") of the reading frames

Stray tensors: a tensor made without naming its device lands on the default device, the CPU, which on a GPU run is
not the model's. Under `stray_device()` such a tensor lands on the meta device instead, so the first operation that
mixes it with the model's tensors fails here as it would on a GPU ("Tensor on device meta is not on the expected
device cpu!"), and copying data out of it fails too. `audited(fn)` runs a function so (wrap a model's `forward` to
audit the model's work only: data made outside it keeps the CPU).

    with stray_device():
        model(input_ids=tok, attention_mask=mask, past_key_values=cache)
"""

from __future__ import annotations

import collections
import contextlib
import functools
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero")
HOST_METHODS = ("tolist", "numpy")


class HostReads(TorchDispatchMode):
    """Counts host reads by op and by the innermost frame of this project (or, outside it, of transformers) that
    made them."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __enter__(self):
        # tolist() and numpy() read a tensor's memory without dispatching an op: counted through the methods
        self._methods = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, self._counting(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counting(self, name, method):
        def read(tensor, *args, **kwargs):
            self.sites[name, _site()] += 1
            return method(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in READ_OPS or (name in ("_to_copy", "copy_") and src is not None and src.is_cuda
                                and str(kwargs.get("device", "cuda")).startswith("cpu")):
            self.sites[name, _site()] += 1
        return func(*args, **kwargs)


def _site() -> str:
    frames = traceback.extract_stack()
    for marker in ("/mla_quant/", "/transformers/"):
        ours = [f for f in frames if marker in f.filename and not f.filename.endswith("audit.py")]
        if ours:
            f = ours[-1]
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.name}"
    return "elsewhere"


class _MixedDevices(TorchDispatchMode):
    """Refuses an op whose tensors are on the meta device and on another (some ops, such as indexing with a meta
    index, would otherwise run and give arbitrary values)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if "meta" in devices and len(devices) > 1:
            raise RuntimeError(f"{func}: a tensor made without naming its device (on the meta device under the audit) "
                               f"meets the model's {sorted(devices - {'meta'})} tensors, in {_site()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def stray_device():
    """While active, tensors made without a device land on the meta device, and an op that mixes one with tensors
    on another device is refused, naming the function that ran it (see the module docstring)."""
    with torch.device("meta"), _MixedDevices():
        yield


def audited(fn):
    """`fn` run under `stray_device()`."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with stray_device():
            return fn(*args, **kwargs)
    return run
