"""Fitted transforms on disk: safetensors with provenance, reused when the same configuration asks again (the file's
name, identity and provenance are the artifact store's, mla_quant/artifacts.py).

    save_transforms(path, tset, provenance)              # atomic; metadata: provenance + tensor checksum
    tset = load_transforms(path, num_layers, config_sha) # None (with the reason printed) if absent, stale or corrupt

Provenance (strings): seed, calibration-data SHA-256, config SHA-256 (model identity, transform, objective, calib,
the fitted-for cache format), a SHA-256 over the stored tensors, library versions, and the per-layer report (JSON).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from mla_quant.transforms import TransformSet


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_transforms(path: Path, tset: TransformSet, provenance: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.cpu() for k, v in tset.tensors().items()}
    meta = {**{k: str(v) for k, v in provenance.items()}, "tensors_sha256": tensors_sha256(tensors),
            "num_layers": str(len(tset.layers))}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if not tensors:  # safetensors needs at least one tensor: an all-identity set stores a marker
        tensors = {"identity": torch.zeros(1)}
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)  # readers see the old file or the whole new one, never a partial write
    return path


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_transforms(path: Path, num_layers: int, config_sha: str) -> TransformSet | None:
    """The stored set if it exists, was made for `config_sha` and its tensors match their checksum; else None."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        meta = read_metadata(path)
        tensors = {k: v for k, v in load_file(str(path)).items() if k != "identity"}
    except Exception as err:  # truncated or foreign file: recalibrate rather than fail
        print(f"[calibrate] ignoring unreadable {path} ({type(err).__name__}: {err}); calibrating again")
        return None
    if meta.get("config_sha256") != config_sha:
        print(f"[calibrate] {path} was made for another configuration; calibrating again")
        return None
    if meta.get("tensors_sha256") != tensors_sha256(tensors) or meta.get("num_layers") != str(num_layers):
        print(f"[calibrate] {path} fails its checksum; calibrating again")
        return None
    return TransformSet.from_tensors(tensors, num_layers, meta)
