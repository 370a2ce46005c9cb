"""Host reads: device values read on the host while the model works (`.item()`, `int()`/`bool()` of a tensor,
`nonzero`, `tolist()`, a copy of a CUDA tensor to the CPU). On a GPU each is a stream synchronisation, and CUDA graph capture
refuses them; counted here on any device, with the project's function that made each read.

    with HostReads() as reads:
        model(input_ids=tok, attention_mask=mask, past_key_values=cache)
    reads.count, reads.sites           # Counter of (op, "module.py:function") of the reading frames
"""

from __future__ import annotations

import collections
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
    frames = traceback.extract_stack()[:-3]
    for marker in ("/mla_quant/", "/transformers/"):
        ours = [f for f in frames if marker in f.filename and not f.filename.endswith("audit.py")]
        if ours:
            f = ours[-1]
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.name}"
    return "elsewhere"
