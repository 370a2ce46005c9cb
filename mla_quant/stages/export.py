"""Stage: write a transformers checkpoint with the configured transforms fused into its weights, plus the cache
format per path, so a serving engine loads the weights as an ordinary checkpoint.

    python run.py experiment=export transform=quantmla quant=int4_joint
    -> <run_dir>/checkpoint/ (save_pretrained: config.json, model.safetensors, the tokenizer if the model has one)
       <run_dir>/checkpoint/mla_quant_cache.json (format per path, protected region, transform and its provenance)

The stage reloads the written checkpoint with `from_pretrained` and checks that, with the cache unquantized, its
float32 logits equal the original (untransformed) model's within task.tolerance (relative): metric
export/logits_rel_err; a larger error fails the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from mla_quant.models.families import family_for_config
from mla_quant.prepare import build_model, prepare_model, rope_layout
from mla_quant.quant.formats import PATHS
from mla_quant.quant.peers import refuse_peer
from mla_quant.record import write_json_atomic
from mla_quant.serving import CACHE_FILE
from mla_quant.stages import StageResult


def cache_description(prep) -> dict:
    fmt = prep.fmt
    if fmt is None:
        return {"format": "none"}
    one = fmt.uniform
    if one is None:  # a format per cache layer (quant.layers, quant=mixed's allocation, lloyd codebooks)
        out = {"format": fmt.name, "mode": fmt.mode, "layers": fmt.describe(),
               "bytes_per_token_per_layer": fmt.bytes_per_token(2), "allocation": fmt.source,
               "protected": {"n_sink": fmt.n_sink, "recent": fmt.recent}, "d_c": max(f.d_c for f in fmt.layers),
               "d_r": max(f.d_r for f in fmt.layers), "layer_dims": [[f.d_c, f.d_r] for f in fmt.layers],
               # each layer's paths as quant.layers entries: what an engine rebuilds the formats from
               "layers_quant": [{p: f.path(p).to_cfg() for p in PATHS} for f in fmt.layers]}
        books = [{p: list(f.path(p).levels) for p in PATHS if f.path(p).levels is not None}
                 for f in fmt.layers]
        if any(books):  # quantizer=lloyd: each layer's levels, x = levels[q] s + z
            out["codebooks"] = books
        return out
    return {"format": one.name, "mode": one.mode, "content": one.content.describe(), "rope": one.rope.describe(),
            "protected": {"n_sink": one.n_sink, "recent": one.recent}, "d_c": one.d_c, "d_r": one.d_r}


def write_checkpoint(model, out: Path, shard_mb: float | None = None) -> list[str]:
    """save_pretrained (shards of at most `shard_mb` MB; None: its default), with a block-FP8 model's
    `quantization_config` listing the projections the folds rewrote in full precision (`model.mla_dequantized`) as
    not quantized, so transformers loads those as plain linears and the rest as FP8. Returns those module names."""
    dequantized = sorted(getattr(model, "mla_dequantized", []) or [])
    qc = getattr(model.config, "quantization_config", None)
    if qc is not None and dequantized:
        qc = dict(qc) if isinstance(qc, dict) else qc.to_dict()
        qc["modules_to_not_convert"] = sorted(set(qc.get("modules_to_not_convert") or []) | set(dequantized))
        model.config.quantization_config = qc
    model.save_pretrained(out, **({} if shard_mb is None else {"max_shard_size": f"{max(1, int(shard_mb * 1000))}KB"}))
    return dequantized


def export_checkpoint(cfg: DictConfig, out: Path):
    """Write the prepared model (transforms fused) to `out` with its tokenizer and `mla_quant_cache.json`.
    -> (the preparation, the cache description written)."""
    refuse_peer(cfg.get("quant"), "experiment=export (the cache description serving engines read)")
    prep = prepare_model(cfg, absorbed=False)
    model = prep.model
    dequantized = write_checkpoint(model, out, cfg.task.get("shard_mb"))
    if prep.tokenizer is not None:
        prep.tokenizer.save_pretrained(out)
    description = _describe(cfg, prep, family_for_config(model.config).name, dequantized)
    write_json_atomic(out / CACHE_FILE, description)
    return prep, description


def _describe(cfg: DictConfig, prep, family: str, dequantized: list[str]) -> dict:
    """What mla_quant_cache.json says of an exported checkpoint."""
    tm = prep.transform_metrics or {}
    return {
        "cache": {**cache_description(prep), "rope_layout": rope_layout(cfg.model)},
        "quant": OmegaConf.to_container(cfg.quant, resolve=True),
        "transform": OmegaConf.to_container(cfg.transform, resolve=True),
        "calibration": {k: v for k, v in tm.items() if k in ("calib/file", "calib/format", "calib/seconds")},
        "family": family,
        # block-FP8 projections the transforms rewrote, stored in the model's compute dtype
        "dequantized_modules": dequantized,
    }


def streamed_export(cfg: DictConfig, out: Path):
    """`export_checkpoint` for a model streamed layer by layer (model.streaming=true): each decoder layer read,
    its transforms folded, written to the shards and released (task.shard_mb per shard), so the whole model is
    never in memory. -> (the preparation, the cache description written)."""
    from mla_quant.prepare import prepare_streamed

    refuse_peer(cfg.get("quant"), "experiment=export (the cache description serving engines read)")
    stream, prep = prepare_streamed(cfg)
    try:
        stream.export(out, int(float(cfg.task.shard_mb) * 1e6))
    finally:
        stream.close()
    if prep.tokenizer is not None:
        prep.tokenizer.save_pretrained(out)
    description = _describe(cfg, prep, stream.family.name, [])
    write_json_atomic(out / CACHE_FILE, description)
    prep.transform_metrics = {**(prep.transform_metrics or {}), **stream.figures()}
    return prep, description


def streamed_check(cfg: DictConfig, out: Path, ids: torch.Tensor) -> float:
    """The exported folder's logits against the original checkpoint's, both streamed (relative error)."""
    from mla_quant.models.build import resolve_device, streamed_model

    device = resolve_device(str(cfg.get("device", "auto")))
    logits = []
    for path in (cfg.model.path, out):
        node = OmegaConf.merge(cfg.model, {"path": str(path)})
        stream = streamed_model(node, device)
        try:
            logits.append(stream.logits(ids).cpu())
        finally:
            stream.close()
    ref, got = logits
    return float((got - ref).norm() / ref.norm())


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    out = run_dir / "checkpoint"
    if cfg.model.get("streaming"):
        prep, description = streamed_export(cfg, out)
        vocab = prep.model.config.get_text_config(decoder=True).vocab_size
        g = torch.Generator().manual_seed(int(cfg.seed))
        ids = torch.randint(3, vocab, (2, int(task.prompt_tokens)), generator=g)
        return _checked(task, out, prep, description, streamed_check(cfg, out, ids))
    prep, description = export_checkpoint(cfg, out)
    model = prep.model

    family = family_for_config(model.config)
    reloaded = family.model_class.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                  use_kernels=False).eval()
    original = build_model(cfg.model, absorbed=False, dtype="float32").eval()
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(int(cfg.seed))
    ids = torch.randint(3, vocab, (2, int(task.prompt_tokens)), generator=g)
    with torch.no_grad():
        ref = original(ids.to(next(original.parameters()).device)).logits.float().cpu()
        got = reloaded(ids.to(next(reloaded.parameters()).device)).logits.float().cpu()
    rel = float((got - ref).norm() / ref.norm())
    return _checked(task, out, prep, description, rel)


def _checked(task, out: Path, prep, description: dict, rel: float) -> StageResult:
    metrics = {**prep.metrics(), "export/logits_rel_err": rel, "export/path": str(out)}
    print(f"[export] {out}: reloaded logits vs the original model: relative error {rel:.2e} "
          f"(tolerance {float(task.tolerance):g}); cache format: {json.dumps(description['cache'])}")
    if rel > float(task.tolerance):
        return StageResult(metrics=metrics, ok=False,
                           message=f"the exported checkpoint changes the function: relative logits error {rel:.2e} > "
                                   f"task.tolerance={float(task.tolerance):g}")
    return StageResult(metrics=metrics)
