"""The fit loop: every block's transforms in one sweep over the decoder layers (docs/method.md section 4).

    tset, report = fit_all(model, ids, transform_cfg, objective_cfg, fmt, seed, checkpoints=...)
"""

from __future__ import annotations

import functools
import time

import torch
from tqdm.auto import tqdm

from mla_quant.calibration.capture import CAPTURES
from mla_quant.calibration.fit import fit_content, fit_rope
from mla_quant.calibration.objectives import rope_output_bound, ste_quantizer
from mla_quant.calibration.options import OBJECTIVES, fit_options, kinds
from mla_quant.models.absorbed import absorbed_view, attention_modules
from mla_quant.models.build import _plain
from mla_quant.quant.formats import PATHS, CacheFormat, CacheSpec, layer_format
from mla_quant.transforms import KINDS, LayerTransform, TransformSet

def fit_all(model, ids: torch.Tensor | None, transform_cfg, objective_cfg, fmt: CacheFormat | CacheSpec,
            seed: int, batch_size: int = 8, checkpoints=None, query_tokens: int | None = None,
            capture: str = "sweep", stream=None) -> tuple[TransformSet, list[dict]]:
    """Fit (or compute) every block's transforms; the per-layer report rows (objective error before and after).
    `checkpoints`: keep each fitted layer on disk and continue from the layers found there. `query_tokens`: the
    per-head query tensors at that many positions per sequence (None: all). `capture`: "sweep" (one pass over the
    decoder layers) or "stopped" (one forward stopped at each block; the reference). `stream`: the model streamed
    layer by layer (mla_quant.models.streaming; the sweep only), `model` its skeleton."""
    if capture not in CAPTURES:
        raise ValueError(f"capture={capture!r}; allowed: {sorted(CAPTURES)}")
    if stream is not None and capture != "sweep":
        raise ValueError(f"capture={capture!r} reruns the model per block: a streamed model is captured by the sweep")
    k = kinds(transform_cfg)
    objectives = {p: (_plain(objective_cfg).get(p) or {}).get("kind") or OBJECTIVES[p][0] for p in PATHS}
    opts = fit_options(transform_cfg, seed)
    # one quantizer per layer and path (a lloyd path's levels are fitted on its own layer's latents), in the layer's
    # own format (a model whose layers' dims differ: a CacheSpec of one option)
    quant = lambda i: {p: ste_quantizer(layer_format(fmt, i).path(p), layer_format(fmt, i).dim(p))  # noqa: E731
                       for p in PATHS}
    modules = attention_modules(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)  # end-to-end objectives backpropagate through the model, never into its weights
    try:
        with absorbed_view(model):  # the capture's forwards through the blocked absorbed attention: linear memory
            captures = CAPTURES[capture] if stream is None else functools.partial(CAPTURES[capture], stream=stream)
            return _fit_layers(model, ids, k, objectives, opts, quant, fmt, modules, batch_size, seed, checkpoints,
                               query_tokens, captures)
    finally:
        for p in trainable:
            p.requires_grad_(True)


def _fit_layers(model, ids, k, objectives, opts, quant, fmt, modules, batch_size, seed, checkpoints, query_tokens,
                captures):
    layers, report = [], []
    sweep = None  # one pass over the decoder layers, started at the first layer that is not fitted yet
    for i in tqdm(range(len(modules)), desc="calibrate", unit="layer"):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        lt = LayerTransform()
        if ids is None:  # data-free kinds only
            lt.rotation, lt.scale = KINDS["content"][k["content"]].free(modules[i].kv_lora_rank, g)
            lt.angle, lt.pair_scale = KINDS["rope"][k["rope"]].free(modules[i].qk_rope_head_dim, g)
            layers.append(lt)
            continue
        done = checkpoints.load(i) if checkpoints is not None else None
        if sweep is not None and done is not None:
            next(sweep)  # keep the sweep at layer i: its outputs are the next layers' inputs
        if done is not None:  # fitted by an earlier, interrupted attempt of this configuration
            layers.append(done[0])
            report.extend(done[1])
            continue
        if sweep is None:
            sweep = captures(model, ids, batch_size, start=i, query_tokens=query_tokens)
        cap = next(sweep)
        quant_i, fmt_i = quant(i), layer_format(fmt, i)
        start = time.perf_counter()
        content_kind = k["content"] if fmt_i.content.quantized else "none"
        lt.rotation, lt.scale, c_err = fit_content(cap, content_kind, objectives["content"], quant_i["content"], opts,
                                                   g)
        c_sec = time.perf_counter() - start
        rope_kind = k["rope"] if fmt_i.rope.quantized else "none"
        start = time.perf_counter()
        lt.angle, lt.pair_scale, r_err = fit_rope(cap, rope_kind, objectives["rope"], quant_i["rope"], opts)
        r_sec = time.perf_counter() - start
        n, device = modules[i].qk_rope_head_dim // 2, cap.k_rope.device
        phi = None if lt.angle is None else lt.angle.to(device)
        t = torch.ones(n, device=device) if lt.pair_scale is None else lt.pair_scale.to(device)
        bound = rope_output_bound(cap, phi, t, quant_i["rope"])
        report.append({"layer": i, "path": "content", "kind": content_kind, "objective": objectives["content"],
                       "error_none": c_err["none"], "error": c_err["fitted"], "seconds": c_sec})
        report.append({"layer": i, "path": "rope", "kind": rope_kind, "objective": objectives["rope"],
                       "error_none": r_err["none"], "error": r_err["fitted"], "seconds": r_sec,
                       "output_error": bound["measured"], "output_bound": bound["bound"]})
        layers.append(LayerTransform(*(None if v is None else v.detach().double().cpu()
                                       for v in (lt.rotation, lt.scale, lt.angle, lt.pair_scale))))
        if checkpoints is not None:
            checkpoints.save(i, layers[-1], report[-2:])
        del cap
    return TransformSet(layers), report


def report_metrics(report: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in report:
        out[f"calib/layer{row['layer']}/{row['path']}/error"] = row["error"]
        out[f"calib/layer{row['layer']}/{row['path']}/error_none"] = row["error_none"]
    for path, keys in (("content", ("error", "error_none")),
                       ("rope", ("error", "error_none", "output_error", "output_bound"))):
        rows = [r for r in report if r["path"] == path]
        for key in keys if rows else ():
            out[f"calib/{path}/{key}"] = sum(r[key] for r in rows) / len(rows)
    return out
