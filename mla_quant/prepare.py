"""The one preparation step every stage uses: config -> validated settings -> model, tokenizer, dims, cache format,
with the configured transforms fitted (or reused) and folded into the weights.

    prep = prepare_model(cfg)                  # cfg: the run's config (model, quant, transform, objective groups)
    prep.model, prep.tokenizer, prep.dims      # absorbed model on its device; {"d_c", "d_r", "layers", "context"}
    cache = prep.new_cache()                   # a fresh latent cache in the configured format

Order (docs/layering.md): (1) read the latent dims from the model YAML or the checkpoint's config.json, without
any weight; (2) validate quant, transform and objective against them, so a bad setting fails in seconds even for a
671B checkpoint; (3) load the weights; (4) fold the configured transforms into the weights, calibrating them first
unless the same configuration was calibrated before (mla_quant.calibration); (5) absorb; (6) place on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hydra.utils import get_method
from omegaconf import DictConfig, ListConfig
from torch import nn

from mla_quant.artifacts import model_identity
from mla_quant.cache import layer_factory
from mla_quant.calibration import calibrated_transforms, check_transform, transformed_format, weights_sha256
from mla_quant.calibration.codebooks import fitted_codebooks, uses_lloyd
from mla_quant.calibration.data import calibration_ids, check_calib, resolve_source, text_ids
from mla_quant.calibration.options import check_family_transform, check_layered_transform
from mla_quant.eval.harness import ContextTooLong
from mla_quant.models.absorbed import absorb, attention_blocks, latent_dims, new_cache
from mla_quant.models.build import (_plain, check_tokenizer_files, load_tokenizer, pretrained_config,
                                    tiny_config)
from mla_quant.models.families import dims_of, family_for_config, text_config
from mla_quant.models.fp8 import check_fp8_config
from mla_quant.models.streaming import check_streaming
from mla_quant.plan import MemoryPlan, memory_plan
from mla_quant.plan import mode_of as plan_mode
from mla_quant.quant.formats import PATHS, CacheSpec, as_spec, model_format
from mla_quant.quant.quantizers import FITTED
from mla_quant.sensitivity.allocation import MixedSpec, allocate, is_mixed, mixed_spec
from mla_quant.transforms import apply_transforms

# Keys of a model YAML that describe the model for other config groups, not arguments of its builder.
MODEL_METADATA_KEYS = ("tokenizer", "quant_group_size", "resources")


def _toy_config(node: Mapping):
    from mla_quant.toy.model import load_toy_config

    return load_toy_config(node.get("path"))


def _tiny_config(node: Mapping):
    return tiny_config(node["family"], node.get("config"))


def _pretrained_config(node: Mapping):
    return pretrained_config(node["family"], node["hf_id"], node.get("revision"), node.get("path"),
                             node.get("config"))


# How each model builder's config is read without its weights (the `_target_` of conf/model/*.yaml).
CONFIG_READERS = {
    "mla_quant.models.build.tiny_model": _tiny_config,
    "mla_quant.models.build.config_only": _tiny_config,
    "mla_quant.models.build.pretrained_model": _pretrained_config,
    "mla_quant.toy.model.load_toy_model": _toy_config,
}


def model_config(model_cfg) -> Any:
    """The transformers config a model YAML describes, read without loading any weight."""
    target = model_cfg.get("_target_")
    reader = CONFIG_READERS.get(target)
    if reader is None:
        raise ValueError(f"model._target_={target!r} has no config reader; allowed: {sorted(CONFIG_READERS)}")
    config = reader({k: v for k, v in _plain(model_cfg).items() if k not in MODEL_METADATA_KEYS})
    family = family_for_config(config)
    check_fp8_config(config)
    if model_cfg.get("family") is not None and family.name != model_cfg.family:
        raise ValueError(f"model.family={model_cfg.family!r} but the model's model_type {config.model_type!r} belongs "
                         f"to family {family.name!r}; set model.family={family.name}")
    return config


def model_dims(model_cfg) -> dict:
    """The latent dims of a model YAML (`families.dims_of`: each MLA layer's (d_c, d_r), the number of layers, the
    largest d_c and d_r) and its "context", without loading any weight."""
    config = model_config(model_cfg)
    return dims_of(family_for_config(config).layer_dims(config),
                   context=int(text_config(config).max_position_embeddings))


def rope_layout(model_cfg) -> str:
    """The model's RoPE pair layout in the cache (`half` | `interleaved`), from its config alone."""
    config = model_config(model_cfg)
    return family_for_config(config).cached_rope_layout(config)


def validate(cfg: DictConfig, dims: Mapping[str, int], quant: bool = True, calib_report: bool = False
             ) -> CacheSpec | MixedSpec | None:
    """Check the quant, transform, objective and calib groups against the model's dims; the resolved cache spec
    (for quant=mixed its validated request, allocated once the model is loaded). calib_report=True: calibration data is
    read even for a data-free transform (experiment=calibrate)."""
    check_transform(cfg.get("transform"), cfg.get("objective"))
    check_family_transform(family_for_config(model_config(cfg.model)), cfg.get("transform"))
    attention_blocks(cfg.get("attention"))
    from mla_quant.calibration import needs_data

    mixed = quant and is_mixed(cfg.get("quant"))
    lloyd = quant and quant_uses_lloyd(cfg.get("quant"))
    if needs_data(cfg.get("transform")) or calib_report or mixed or lloyd:
        if cfg.get("calib") is None:
            if lloyd:
                raise ValueError(f"quant={cfg.quant.get('name')!r} has a quantizer=lloyd path: its codebooks are "
                                 "fitted on calibration latents: add calib=<option>")
            if mixed:
                raise ValueError(f"quant={cfg.quant.get('name')!r} measures each width's cache NMSE on calibration "
                                 "latents: add calib=<option>")
            raise ValueError(f"transform={cfg.transform.get('name')!r} needs calibration data: add calib=<option>")
        check_calib(cfg.calib, resolve_source(cfg.calib, cfg.model.get("_target_")))
        check_context("calib.seq_len", cfg.calib.seq_len, dims)
        objectives = {(cfg.get("objective") or {}).get(p, {}).get("kind") for p in PATHS}
        if cfg.calib.get("query_tokens") is not None and "next_token_kl" in objectives:
            raise ValueError(f"calib.query_tokens={cfg.calib.query_tokens}: objective next_token_kl replaces the "
                             "attention output at every token and needs every query; set calib.query_tokens=null")
    if not quant or cfg.get("quant") is None:
        return None
    if mixed:
        if len(set(dims["layer_dims"])) > 1:
            raise ValueError(f"quant={cfg.quant.get('name')!r} allocates widths from one (d_c, d_r) for every layer; "
                             f"this model's MLA layers differ ({sorted(set(dims['layer_dims']))}): use a uniform "
                             "option, or give each layer its widths with quant.layers")
        spec = mixed_spec(cfg.quant, dims["d_c"], dims["d_r"], dims["layers"], dims["context"],
                          _plain(cfg.model.get("quant_group_size")) or None, rope_layout(cfg.model))
        codec = (_plain(cfg.get("transform") or {}).get("content") or {}).get("codec")
        if codec is not None or spec.budget_name is None:  # else the transforms are fitted for the budget's option
            check_layered_transform(cfg.get("transform"), spec.name, codec)
        return spec
    return transformed_format(cfg.get("transform"), model_format(cfg.quant, dims["layer_dims"], dims["context"],
                                                                 rope_layout=rope_layout(cfg.model)))


def quant_uses_lloyd(quant_cfg) -> bool:
    """A quant config (before it is validated) with a quantizer=lloyd path, in its blocks, its layers or its
    choices (quant=mixed)."""
    if quant_cfg is None:
        return False
    cfg = _plain(quant_cfg)
    blocks = [cfg.get(p) for p in PATHS]
    blocks += [(entry or {}).get(p) for entry in (cfg.get("layers") or []) for p in PATHS]
    blocks += [c for p in PATHS for c in ((cfg.get("choices") or {}).get(p) or [])]
    return any(isinstance(b, Mapping) and b.get("quantizer") in FITTED for b in blocks)


def check_context(key: str, value, dims: Mapping[str, int]) -> None:
    """A sequence length (or a list of them) a setting asks for, within the model's positions
    (config.max_position_embeddings, read from the config alone): else refused by name before any weight is read."""
    lengths = [int(n) for n in value] if isinstance(value, (list, tuple, ListConfig)) else [int(value)]
    too_long = [n for n in lengths if n > dims["context"]]
    if too_long:
        shown = too_long if isinstance(value, (list, tuple, ListConfig)) else too_long[0]
        raise ContextTooLong(f"{key}: {shown} exceeds the model's limit of {dims['context']} positions "
                             f"(config.max_position_embeddings)")


def build_model(model_cfg, **overrides) -> nn.Module:
    """Call the model YAML's builder with its arguments (metadata keys left out) and `overrides`."""
    node = {k: v for k, v in _plain(model_cfg).items() if k not in MODEL_METADATA_KEYS and k != "_recursive_"}
    builder = get_method(node.pop("_target_"))
    try:
        return builder(**{**node, **overrides})
    except TypeError as err:
        if "unexpected keyword" in str(err):
            raise ValueError(f"model config: {err} (builder {builder.__module__}.{builder.__name__})") from err
        raise


@dataclass
class Prepared:
    model: nn.Module
    tokenizer: Any
    dims: dict[str, int]
    # resolved for the model's layers (None: the stage does not use quant); quant=mixed: the allocated formats
    fmt: CacheSpec | None
    transform_metrics: dict | None = None  # transform name, calibration file, seconds, objective errors
    calib_report: list | None = None  # per layer and path: objective error without and with the transform
    # quant=mixed: the allocation's file, budget, bits per layer and path; quantizer=lloyd: the codebooks' file
    alloc_metrics: dict | None = None
    plan_metrics: dict | None = None  # the memory plan's predicted peak and components (mla_quant.plan)

    def __post_init__(self):  # a format given alone is the spec of it repeated over the model's layers
        self.fmt = as_spec(self.fmt, int(self.dims.get("layers") or 1))

    def layer_factory(self):
        return None if self.fmt is None else layer_factory(self.fmt)

    def new_cache(self):
        return new_cache(self.model, self.layer_factory())

    def metrics(self) -> dict:
        """What this preparation did, for the run record: cache format per path and the transforms."""
        return {**self.cache_metrics(), **(self.transform_metrics or {}), **(self.alloc_metrics or {}),
                **(self.plan_metrics or {})}

    def cache_metrics(self) -> dict[str, str | float]:
        """What the cache stores per path, with the dtype actually stored (the toy runs in float32, so its
        unquantized tokens are float32, not bf16)."""
        param = next(self.model.parameters())
        # a streamed model's skeleton: the dtype and device its resident layers compute in
        compute, device = getattr(self.model, "mla_streamed", (param.dtype, param.device))
        dtype = str(compute).replace("torch.", "")
        backends = {} if self.fmt is None else {f"cache/backend/{step}": backend for step, backend
                                                in self.fmt.step_backends(device.type).items()}
        # bytes per token per layer of the BF16 cache the analysis compares against: mean over layers
        layer_dims = self.dims.get("layer_dims") or [(self.dims["d_c"], self.dims["d_r"])]
        bf16 = sum(c + r for c, r in layer_dims) * 2 / len(layer_dims)
        one = None if self.fmt is None else self.fmt.uniform
        if self.fmt is not None and self.fmt.peer:  # transformers' QuantizedCache: nominal bytes at 2 B scales, zeros
            return {"cache/content": one.describe(), "cache/rope": one.describe(),
                    "cache/protected": f"the latest < {one.residual_length} per sequence, {dtype}",
                    "cache/bytes_per_token_per_layer": float(one.bytes_per_token(2)), **backends}
        if self.fmt is None or not self.fmt.quantized:
            return {"cache/content": f"{dtype} values", "cache/rope": f"{dtype} values", "cache/protected": "none",
                    "cache/bytes_per_token_per_layer": float(bf16), **backends}
        protected = f"{self.fmt.n_sink} sinks + {self.fmt.recent} recent per sequence, {dtype}"
        if one is None:  # per layer, and the mean over layers
            per_layer = self.fmt.bytes_per_token(2)
            out = {"cache/content": "per layer", "cache/rope": "per layer", "cache/protected": protected,
                   "cache/bytes_per_token_per_layer": float(sum(per_layer) / len(per_layer))}
            for i, (paths, b) in enumerate(zip(self.fmt.describe(), per_layer)):
                out.update({f"cache/layer{i}/{p}": d for p, d in paths.items()})
                out[f"cache/layer{i}/bytes_per_token"] = float(b)
            return {**out, **backends}
        out = {f"cache/{p}": (one.path(p).describe() if one.path(p).quantized else f"{dtype} values") for p in PATHS}
        out["cache/protected"] = protected
        # outside the protected region, with BF16 for unquantized paths (as stored on real checkpoints)
        out["cache/bytes_per_token_per_layer"] = float(one.bytes_per_token(2))
        return {**out, **backends}


def preflight(cfg: DictConfig, *, quant: bool = True, tokenizer: bool = True, calib_report: bool = False,
              host: dict[str, float] | None = None
              ) -> tuple[dict[str, int], CacheSpec | MixedSpec | None, MemoryPlan | None]:
    """Everything `prepare_model` refuses, done without reading any weight: the model's dims from its config alone,
    the quant/transform/objective/calib settings against them, the tokenizer's files (before loading it), and the
    calibration data (a text dataset loaded, so an offline machine is told now, naming the setting), the memory plan.
    -> (dims, the validated format, the plan or None). Pipelines call it for every step before the first one runs."""
    refuse_unstreamed(cfg)
    dims = model_dims(cfg.model)
    fmt = validate(cfg, dims, quant=quant, calib_report=calib_report)
    if tokenizer or needs_tokenizer(cfg, calib_report):
        check_tokenizer_files(cfg.model.get("tokenizer"))
    if needs_calibration_data(cfg, quant, calib_report) and resolve_source(cfg.calib, cfg.model.get("_target_")) \
            == "text":  # loaded and cut into calib.samples x calib.seq_len tokens now, not after the weights
        check_calib(cfg.calib, "text")
        text_ids(cfg.calib, load_tokenizer(cfg.model), int(cfg.calib.samples), int(cfg.calib.seq_len))
    plan = plan_memory(cfg, fmt, host)  # the stage's peak against the device's: one that cannot fit is refused now
    return dims, fmt, plan


def plan_memory(cfg: DictConfig, fmt, host: dict[str, float] | None = None) -> MemoryPlan | None:
    """The memory plan of `cfg`'s stage with the validated format `fmt` (None where it has none or memory_plan=off),
    `host` what the stage holds already (measured); memory_plan=check refuses a run that cannot fit (MemoryError)."""
    from mla_quant.calibration import fitted_paths
    from mla_quant.calibration.capture import EVAL_CHUNK
    from mla_quant.models.build import resolve_device

    mode = plan_mode(cfg)
    if mode is None or cfg.model.get("streaming"):  # a streamed stage holds one layer: its record has the figures
        return None
    fmt = getattr(fmt, "budget_format", fmt)  # quant=mixed: the named option of its budget's bytes
    plan = memory_plan(cfg, model_config(cfg.model), fmt, resolve_device(str(cfg.get("device", "auto"))),
                       fitted=bool(fitted_paths(cfg.get("transform"))), eval_chunk=EVAL_CHUNK, host=host)
    if mode == "check":
        plan.check()
    return plan


def needs_calibration_data(cfg: DictConfig, quant: bool = True, calib_report: bool = False) -> bool:
    """Whether preparing `cfg` reads calibration data: a transform fitted on data, quant=mixed, lloyd codebooks, or
    experiment=calibrate's report."""
    from mla_quant.calibration import needs_data

    return bool(needs_data(cfg.get("transform")) or calib_report
                or (quant and (is_mixed(cfg.get("quant")) or quant_uses_lloyd(cfg.get("quant")))))


def prepare_model(cfg: DictConfig, *, quant: bool = True, tokenizer: Any = True, absorbed: bool = True,
                  calib_report: bool = False, host: dict[str, float] | None = None,
                  validated: tuple[dict, Any] | None = None, **build_overrides) -> Prepared:
    """Validate, then load, transform, absorb and place the model of `cfg.model` (see the module docstring).
    quant=False: the stage does not use the quant group. tokenizer=False: do not load one; a tokenizer: the model's,
    loaded already by the stage (its files were checked then), used as is. calib_report=True: report
    the calibration objectives per layer even for transforms that fit nothing (experiment=calibrate). host: {what:
    bytes} the stage holds already on the host (measured; the memory plan counts it on the CPU). validated: (dims,
    format) from the stage's own `preflight` of the same settings (its checks done): only the memory plan is made
    again, with what the stage holds now."""
    loaded = None if isinstance(tokenizer, bool) else tokenizer
    tokenizer = tokenizer is not False
    if validated is None:
        dims, fmt, plan = preflight(cfg, quant=quant, tokenizer=tokenizer, calib_report=calib_report, host=host)
    else:
        dims, fmt = validated
        plan = plan_memory(cfg, fmt, host)
    if plan is not None:
        print(plan.table(), flush=True)
    spec = fmt if isinstance(fmt, MixedSpec) else None
    tok = loaded if loaded is not None else (load_tokenizer(cfg.model) if tokenizer or needs_tokenizer(cfg, calib_report)
                                             else None)  # before weights
    model = build_model(cfg.model, absorbed=False, **build_overrides)
    # quant=mixed: fit for the budget's named option
    run_format = fmt if spec is None else as_spec(spec.budget_format, dims["layers"])
    tset, transform_metrics, report = calibrated_transforms(model, cfg, tok, run_format, report=calib_report)
    if tset is not None:
        apply_transforms(model, tset)
    if absorbed:
        model = absorb(model, attention_blocks(cfg.get("attention")))
    alloc_metrics = None
    if spec is not None:
        fmt, alloc_metrics = allocate_formats(model, cfg, tok, spec, transform_metrics)
    if uses_lloyd(fmt):  # quantizer=lloyd: each layer's codebook, fitted on the transformed model's latents
        fmt, book_metrics = codebook_formats(model, cfg, tok, fmt, transform_metrics)
        alloc_metrics = {**(alloc_metrics or {}), **book_metrics}
    measured = latent_dims(model) if absorbed else None
    if measured is not None and measured["layer_dims"] != dims["layer_dims"]:
        raise RuntimeError(f"the loaded model's MLA layers have (d_c, d_r) = {measured['layer_dims']}, its config "
                           f"said {dims['layer_dims']}")
    return Prepared(model, tok if tokenizer else None, dims, fmt, transform_metrics, report, alloc_metrics,
                    plan.metrics() if plan is not None else None)


def _calibration_inputs(model, cfg: DictConfig, tokenizer, transform_metrics: dict | None, stream=None):
    """The calibration ids and the identity (model, weights, transform, data) of what is measured on them. `stream`:
    `model` is a streamed model's skeleton, its fingerprint that of the transformed weights as in memory."""
    source = resolve_source(cfg.calib, cfg.model.get("_target_"))
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = calibration_ids(cfg.calib, source, tokenizer, vocab)
    weights = stream.weights_sha256(after_load=True) if stream is not None else weights_sha256(model)
    identity = {"model": model_identity(_plain(cfg.model)), "weights": weights,
                "transform": (transform_metrics or {}).get("calib/file", "none"),
                "calib": {**_plain(cfg.calib), "source": source}}
    return ids, identity


def allocate_formats(model, cfg: DictConfig, tokenizer, spec: MixedSpec, transform_metrics: dict | None,
                     stream=None):
    """The per-layer formats of quant=mixed for the (transformed) model, measured on the absorbed view of it
    (`stream`: the streamed model whose absorbed skeleton `model` is)."""
    from mla_quant.models.absorbed import absorbed_view

    ids, identity = _calibration_inputs(model, cfg, tokenizer, transform_metrics, stream)
    batch = int(cfg.calib.get("batch_size", 8))
    if stream is not None:
        return allocate(model, spec, ids, identity, batch, stream)
    with absorbed_view(model, attention_blocks(cfg.get("attention"))) as view:
        return allocate(view, spec, ids, identity, batch)


def codebook_formats(model, cfg: DictConfig, tokenizer, fmt, transform_metrics: dict | None, stream=None):
    """The format of every layer with its lloyd codebooks, fitted on the absorbed view of the (transformed) model
    over the calibration batch (or reused), stored beside the fitted transforms (`stream`: the streamed model whose
    absorbed skeleton `model` is)."""
    from mla_quant.models.absorbed import absorbed_view

    ids, identity = _calibration_inputs(model, cfg, tokenizer, transform_metrics, stream)
    cache_dir = (_plain(cfg.get("transform") or {}).get("fit") or {}).get("cache_dir", "outputs/calibration")
    family = family_for_config(model.config).name
    batch = int(cfg.calib.get("batch_size", 8))
    if stream is not None:
        return fitted_codebooks(model, fmt, ids, identity, cache_dir, family, batch, stream)
    with absorbed_view(model, attention_blocks(cfg.get("attention"))) as view:
        return fitted_codebooks(view, fmt, ids, identity, cache_dir, family, batch)


def needs_tokenizer(cfg: DictConfig, calib_report: bool = False) -> bool:
    """Calibration on text or the toy's documents needs the model's tokenizer."""
    from mla_quant.calibration import needs_data

    if not (needs_data(cfg.get("transform")) or calib_report or is_mixed(cfg.get("quant"))
            or quant_uses_lloyd(cfg.get("quant"))) or cfg.model.get("tokenizer") is None:
        return False
    return resolve_source(cfg.calib, cfg.model.get("_target_")) in ("toy", "text")


def prepare_streamed(cfg: DictConfig, *, quant: bool = True, tokenizer: bool = True, calib_report: bool = False):
    """`prepare_model` for a model streamed layer by layer (model.streaming=true, mla_quant.models.streaming): the
    same checks, the skeleton with its layers left on disk, the configured transforms fitted (or reused) through a
    streamed sweep and folded into each layer as it is read; quant=mixed allocated and lloyd codebooks fitted
    through streamed passes over the transformed layers. -> (the StreamedModel, a Prepared whose model is its
    skeleton)."""
    from mla_quant.models.build import resolve_device, streamed_model

    dims, fmt, _ = preflight(cfg, quant=quant, tokenizer=tokenizer, calib_report=calib_report)
    tok = load_tokenizer(cfg.model) if tokenizer or needs_tokenizer(cfg, calib_report) else None
    stream = streamed_model(cfg.model, resolve_device(str(cfg.get("device", "auto"))),
                                       attention_blocks(cfg.get("attention")))
    spec = fmt if isinstance(fmt, MixedSpec) else None
    run_format = fmt if spec is None else as_spec(spec.budget_format, dims["layers"])  # mixed: fit for the budget's
    tset, transform_metrics, report = calibrated_transforms(stream.model, cfg, tok, run_format, report=calib_report,
                                                            stream=stream)
    if tset is not None:  # folded into each layer as it is read; the shapes checked on the skeleton now
        from mla_quant.transforms.fold import check_layer_transform, fold_layer

        family = stream.family
        modules = family.attention_modules(stream.model)
        if len(tset.layers) != len(modules):
            raise ValueError(f"the transform set has {len(tset.layers)} layers but the model has {len(modules)} MLA "
                             "blocks")
        for i, (attn, lt) in enumerate(zip(modules, tset.layers)):
            check_layer_transform(family.mla_weights(attn), lt, f"layer {i}")

        from mla_quant.models import fp8
        from mla_quant.transforms.fold import rewritten_linears

        names = {id(m): n for n, m in stream.model.named_modules()}

        def fold(j, blocks):
            for i, attn in blocks:  # FP8 kept: the projections a fold rewrites become full-precision linears first
                rewritten = fp8.dense(attn, rewritten_linears(attn, tset.layers[i]), stream.dtype)
                stream.model.mla_dequantized = sorted(set(getattr(stream.model, "mla_dequantized", []))
                                                      | {f"{names[id(attn)]}.{n}" for n in rewritten})
                fold_layer(family.mla_weights(attn), tset.layers[i], f"layer {i}")

        stream.after_load.append(fold)
    alloc_metrics = None
    if spec is not None:
        fmt, alloc_metrics = allocate_formats(stream.model, cfg, tok, spec, transform_metrics, stream)
    if uses_lloyd(fmt):
        fmt, book_metrics = codebook_formats(stream.model, cfg, tok, fmt, transform_metrics, stream)
        alloc_metrics = {**(alloc_metrics or {}), **book_metrics}
    return stream, Prepared(stream.model, tok if tokenizer else None, dims, fmt, transform_metrics, report,
                            alloc_metrics)


def refuse_unstreamed(cfg) -> None:
    """With model.streaming=true, what cannot stream, refused by name before the model's config, any data or weight
    is read (`preflight`, and a stage's own checks that come before it): the model settings and the stage
    (`check_streaming`), an objective that reruns the whole model at every fitting step (next_token_kl)."""
    from mla_quant.calibration import fitted_paths

    if not cfg.model.get("streaming"):
        return
    check_streaming(cfg.model, (cfg.get("task") or {}).get("name"))
    objective = cfg.get("objective") or {}
    for path in fitted_paths(cfg.get("transform")):
        kind = (objective.get(path) or {}).get("kind")
        if kind == "next_token_kl":
            raise ValueError(f"model.streaming=true: objective.{path}.kind=next_token_kl reruns the whole model at "
                             "every fitting step, which a streamed model cannot; use the layer-local objectives "
                             "(attention_output / positional_qk, cache_mse)")
