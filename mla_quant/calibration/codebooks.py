"""`quantizer=lloyd`: a codebook per cache layer and path, fitted on the model's own cache latents.

    if uses_lloyd(fmt):
        fmt, metrics = fitted_codebooks(model, fmt, ids, identity, cache_dir)   # each layer's levels in its format
    fmt = fitted_on(fmt, content, rope)     # one format, its levels fitted on given latents (benchmarks, tests)

A lloyd path stores the same codes, scales and zeros as `rtn`, but a code q reads levels[q] (2^bits non-uniform
levels in code units) instead of q. The levels of each (layer, path) are fitted by Lloyd's algorithm, in turn with each
group's range (`mla_quant.quant.quantizers.fit_levels`), on that layer's latents over the calibration batch, after
the configured transforms (which the model already carries), with every token counted (no protected region). The
result is a `CacheSpec` whose layer i carries its levels (`PathFormat.levels`), stored as JSON with its
provenance beside the fitted transforms and reused when the same configuration asks again.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mla_quant.models.absorbed import cached_latents, num_cache_layers
from mla_quant.quant.formats import PATHS, CacheFormat, CacheSpec
from mla_quant.quant.quantizers import FIT_REFERENCES, LLOYD_MAX_VALUES, check_levels, fit_levels
from mla_quant.artifacts import Artifact, artifact

CODEBOOK_VERSION = 2  # 2: the fit starts from clip's ranges


def uses_lloyd(fmt: CacheSpec | None) -> bool:
    """True when some path of some layer of the resolved spec `fmt` is quantizer=lloyd."""
    return fmt is not None and not fmt.peer and any(f.path(p).fitted_levels for f in fmt.identity_layers
                                                    for p in PATHS)


def _per_layer(fmt: CacheSpec, num_layers: int) -> list[CacheFormat]:
    if fmt.uniform is not None:
        return [fmt.uniform] * num_layers
    if len(fmt) != num_layers:
        raise ValueError(f"quant={fmt.name}: {len(fmt)} layer formats for a model with {num_layers} cache layers")
    return list(fmt.layers)


def _wanted(layers: list[CacheFormat]) -> list[tuple[int, str]]:
    return [(i, p) for i, f in enumerate(layers) for p in PATHS if f.path(p).fitted_levels]


def capture_latents(model, ids: torch.Tensor, wanted: list[tuple[int, str]], dims: dict[str, int], batch: int = 8,
                    stream=None) -> dict[tuple[int, str], torch.Tensor]:
    """Each wanted (layer, path)'s cache latents over `ids` (float32, CPU, (N, d)), an even subsample of every
    batch's tokens so that no path keeps more than about LLOYD_MAX_VALUES values. `stream`: the model streamed layer
    by layer (`cached_latents`), the same latents."""
    batches = math.ceil(ids.shape[0] / batch)
    out: dict[tuple[int, str], list[torch.Tensor]] = {key: [] for key in wanted}
    for i, read in cached_latents(model, ids, batch, desc="codebooks: latents", stream=stream):
        for p, x in zip(PATHS, read):
            if (i, p) not in out:
                continue
            x = x.float().reshape(-1, dims[p])
            keep = max(1, LLOYD_MAX_VALUES // dims[p] // batches)
            if x.shape[0] > keep:
                x = x[torch.linspace(0, x.shape[0] - 1, keep, device=x.device).long()]
            out[i, p].append(x.cpu())
    return {key: torch.cat(v) for key, v in out.items()}


def codebook_artifact(fmt: CacheSpec, identity: dict, cache_dir: str | Path, family: str) -> Artifact:
    layers = fmt.identity_layers
    payload = {"version": CODEBOOK_VERSION, "identity": identity,
               # the paths' settings only (their codes' widths, groups and scale dtype): what the levels depend on
               "formats": [[repr(f.path(p)) for p in PATHS] for f in layers]}  # (a repr leaves the levels out)
    return artifact(cache_dir, f"codebooks-{family}", payload, ".json")


def _load(art: Artifact, wanted: list[tuple[int, str]], layers: list[CacheFormat]) -> dict | None:
    stored = art.read_json()
    if stored is None:
        return None
    try:
        levels = {(int(i), p): tuple(float(v) for v in lv) for i, p, lv in stored["levels"]}
        if set(levels) != set(wanted):
            return None
        for (i, p), lv in levels.items():
            check_levels(lv, layers[i].path(p).bits, f"{art.path}: layer {i} {p}")
    except (KeyError, TypeError, ValueError) as err:
        print(f"[codebooks] ignoring unusable {art.path}: {err}")
        return None
    return {**stored, "levels": levels}


def fitted_on(fmt: CacheFormat, content: torch.Tensor, rope: torch.Tensor) -> CacheFormat:
    """`fmt` (one format) with each lloyd path's levels fitted on the given latents (..., d) of that path: for a
    cache filled with known values (benchmarks, tests), where no model's calibration batch applies."""
    paths = {}
    for p, x in (("content", content), ("rope", rope)):
        pf = fmt.path(p)
        if pf.fitted_levels:
            paths[p] = dataclasses.replace(pf, levels=tuple(fit_levels(x, pf.bits, pf.group_size,
                                                                       pf.scale_dtype).tolist()))
    return dataclasses.replace(fmt, **paths)


def with_levels(fmt: CacheSpec, levels: dict[tuple[int, str], tuple[float, ...]], num_layers: int, source: str
                ) -> CacheSpec:
    """`fmt` with each layer's lloyd paths given their levels: one format per cache layer."""
    layers = _per_layer(fmt, num_layers)
    out = []
    for i, f in enumerate(layers):
        paths = {p: dataclasses.replace(f.path(p), levels=levels[i, p]) for p in PATHS if (i, p) in levels}
        f = dataclasses.replace(f, name=f"{fmt.name}/layer{i}", **paths)
        for p in paths:
            f.path(p).check(f.dim(p), f"quant.{p} (layer {i})")
        out.append(f)
    return CacheSpec(fmt.name, tuple(out), source if fmt.uniform is not None else fmt.source)


def _fit(model, ids: torch.Tensor, wanted: list[tuple[int, str]], layers: list[CacheFormat], batch: int,
         stream=None) -> dict:
    """Each wanted (layer, path)'s levels fitted on its latents over `ids`, with the cache NMSE of the fitted codebook
    beside the FIT_REFERENCES quantizers' at the same widths."""
    start = time.perf_counter()
    dims = {"content": layers[0].d_c, "rope": layers[0].d_r}
    latents = capture_latents(model, ids, wanted, dims, batch, stream)
    levels, nmse = {}, {}
    for (i, p), x in tqdm(latents.items(), desc="codebooks: lloyd", unit="path"):
        pf = layers[i].path(p)
        lv = fit_levels(x, pf.bits, pf.group_size, pf.scale_dtype)
        levels[i, p] = tuple(float(v) for v in lv)
        energy = float(x.double().pow(2).sum())
        fitted = dataclasses.replace(pf, levels=levels[i, p])
        others = [(q, dataclasses.replace(pf, quantizer=q)) for q in FIT_REFERENCES]
        nmse[i, p] = {name: float((f.codec.fake_quantize(f, x, None).double() - x.double()).pow(2).sum())
                      / max(energy, 1e-30) for name, f in [(pf.quantizer, fitted), *others]}
    return {"version": CODEBOOK_VERSION, "levels": levels, "nmse": [[i, p, v] for (i, p), v in sorted(nmse.items())],
            "tokens": {f"{i}/{p}": int(x.shape[0]) for (i, p), x in latents.items()},
            "seconds": time.perf_counter() - start, "torch": torch.__version__}


def fitted_codebooks(model, fmt: CacheSpec, ids: torch.Tensor, identity: dict, cache_dir: str | Path, family: str,
                     batch: int = 8, stream=None) -> tuple[CacheSpec, dict]:
    """The codebooks of every lloyd path of `fmt` for `model` (transforms applied; the absorbed view), fitted on
    its latents over `ids` or reused from `cache_dir`, and the record's metrics. `stream`: `model` is the skeleton
    of a model streamed layer by layer (one pass over its layers; the same codebooks)."""
    num_layers = num_cache_layers(model)
    layers = _per_layer(fmt, num_layers)
    wanted = _wanted(layers)
    art = codebook_artifact(fmt, identity, cache_dir, family)
    path = art.path
    with art.held():  # a job fitting the same codebooks is waited for, and its file reused
        stored = _load(art, wanted, layers)
        reused = stored is not None
        if reused:
            print(f"[codebooks] reusing {path}")
        else:
            stored = {**_fit(model, ids, wanted, layers, batch, stream), "identity": identity}
            stored = {**art.write_json({**stored, "levels": [[i, p, list(lv)] for (i, p), lv
                                                             in sorted(stored["levels"].items())]}),
                      "levels": stored["levels"]}
            print(f"[codebooks] lloyd levels of {len(stored['levels'])} layer paths in {stored['seconds']:.1f} s "
                  f"-> {path}")
    out = with_levels(fmt, stored["levels"], num_layers, str(path))
    metrics = {"cache/codebooks": str(path), "cache/codebooks_reused": int(reused),
               "cache/codebook_bytes_per_layer": float(sum(f.codebook_bytes() for f in out.layers) / num_layers)}
    for i, p, v in stored.get("nmse", []):
        metrics.update({f"cache/layer{i}/{p}/nmse_{name}": float(x) for name, x in v.items()})
    return out, metrics
