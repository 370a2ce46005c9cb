"""The transform.* and objective.* options of a run: which kinds each path uses, whether they need calibration data,
the format they are fitted for, and the checks that refuse unknown keys and kinds by name before any model work."""

from __future__ import annotations

import dataclasses
import warnings

from mla_quant.calibration.fit import FitOptions
from mla_quant.calibration.objectives import CONTENT_OBJECTIVES, ROPE_OBJECTIVES
from mla_quant.kernels.backends import DECODE_BACKENDS
from mla_quant.models.build import _plain
from mla_quant.quant.codecs import CONTENT_CODECS
from mla_quant.quant.formats import PATHS, CacheFormat, CacheSpec, as_spec, model_format
from mla_quant.quant.peers import PeerFormat
from mla_quant.transforms import KINDS
from mla_quant.transforms import kind as transform_kind

OBJECTIVES = {"content": CONTENT_OBJECTIVES, "rope": ROPE_OBJECTIVES}
TRANSFORM_KEYS = ("name", "content", "rope", "fit")
FIT_KEYS = ("format", "steps", "lr", "alpha", "batch", "eval_every", "cache_dir", "reuse")
DEFAULT_FIT_FORMAT = "int4_joint"  # fit.format=auto when the run stores no quantized cache


def kinds(transform_cfg) -> dict[str, str]:
    t = _plain(transform_cfg)
    return {p: (t.get(p) or {}).get("kind", "none") for p in PATHS}


def fitted_paths(transform_cfg) -> list[str]:
    """The paths whose kind is fitted (read from the registry, so a kind registered later counts)."""
    k = kinds(transform_cfg)
    return [p for p in PATHS if getattr(KINDS[p].get(k[p]), "fitted", False)]


def needs_data(transform_cfg) -> bool:
    """Whether a path's kind needs calibration data (an unknown kind counts as needing it; it is refused later)."""
    k = kinds(transform_cfg)
    return any(not getattr(KINDS[p].get(k[p]), "data_free", False) for p in PATHS)


def check_transform(transform_cfg, objective_cfg=None) -> None:
    """transform.* and objective.*: unknown keys or kinds refused by name, before any model work (overrides that
    would do nothing are refused by the pipeline, `refuse_idle_calibration`)."""
    t = _plain(transform_cfg)
    unknown = sorted(set(t) - set(TRANSFORM_KEYS))
    if unknown:
        raise ValueError(f"transform: unknown key(s) {unknown}; allowed: {list(TRANSFORM_KEYS)}")
    for path in PATHS:
        node = t.get(path) or {}
        allowed = ["kind", "codec"] if path == "content" else ["kind"]
        extra = sorted(set(node) - set(allowed))
        if extra:
            raise ValueError(f"transform.{path}: unknown key(s) {extra}; allowed: {allowed}")
        if path == "content" and node.get("codec") not in CONTENT_CODECS:
            raise ValueError(f"transform.content.codec={node.get('codec')!r}; allowed: {list(CONTENT_CODECS)}")
        transform_kind(path, node.get("kind", "none"))  # unknown kinds refused with the registered names
    extra = sorted(set(t.get("fit") or {}) - set(FIT_KEYS))
    if extra:
        raise ValueError(f"transform.fit: unknown key(s) {extra}; allowed: {list(FIT_KEYS)}")
    if needs_data(transform_cfg) and not t.get("fit"):
        raise ValueError(f"transform={t.get('name')!r} uses calibration data and needs a transform.fit block")
    o = _plain(objective_cfg)
    extra = sorted(set(o) - {"name", "content", "rope"})
    if extra:
        raise ValueError(f"objective: unknown key(s) {extra}; allowed: ['name', 'content', 'rope']")
    for path in PATHS:
        kind = (o.get(path) or {}).get("kind")
        if kind is not None and kind not in OBJECTIVES[path]:
            raise ValueError(f"objective.{path}.kind={kind!r}; allowed: {list(OBJECTIVES[path])}")


def check_family_transform(family, transform_cfg) -> None:
    """A RoPE kind the model's family cannot fold, refused by name before any weight: a rotation within the pairs of
    a RoPE key RMS-normed before RoPE (dots.3 Note)."""
    from mla_quant.transforms.fold import ROPE_NORM_REFUSAL

    kind = ((_plain(transform_cfg).get("rope") or {}).get("kind")) or "none"
    if family.rope_normed and transform_kind("rope", kind).rotates:
        raise ValueError(f"transform={_plain(transform_cfg).get('name', '?')} (transform.rope.kind={kind}) on "
                         f"{family.name}: {ROPE_NORM_REFUSAL}")


def transformed_format(transform_cfg, fmt: CacheSpec | CacheFormat | None) -> CacheSpec | None:
    """The resolved spec with the transform's content codec in each layer (transform=turboquant: the quant option's
    content bits stored as TurboQuant's codebook with one norm per token instead of per-group scales); a format
    given alone comes back as a spec of it."""
    fmt = as_spec(fmt)
    codec = (_plain(transform_cfg).get("content") or {}).get("codec")
    if fmt is None:
        return None
    if fmt.peer:
        check_peer_transform(transform_cfg, fmt.uniform, codec)
        return fmt
    if not fmt.one_format:
        check_layered_transform(transform_cfg, fmt.name, codec)
        return fmt
    if codec is None:
        return fmt
    layers = tuple(_recoded(f, codec) for f in fmt.layers)  # one option (at each layer's own dims)
    return dataclasses.replace(fmt, name=f"{fmt.name}_{codec}" if layers != fmt.layers else fmt.name, layers=layers)


def _recoded(fmt: CacheFormat, codec: str) -> CacheFormat:
    """One layer's format with its quantized content path stored in `codec`."""
    if not fmt.content.quantized:
        return fmt
    if not fmt.content.integer_groups:
        raise ValueError(f"transform.content.codec={codec} re-encodes an integer content path at its bit width; "
                         f"quant={fmt.name} stores content as {fmt.content.format} (use an int option, e.g. "
                         f"int4_joint)")
    recoded = dataclasses.replace(fmt, name=f"{fmt.name}_{codec}", content=fmt.content.recoded(codec, fmt.d_c))
    kernel = DECODE_BACKENDS.get(fmt.backend)
    why = kernel and kernel.unsupported(recoded)
    if why:
        raise ValueError(f"transform.content.codec={codec}: quant.backend={fmt.backend} cannot read format={codec} "
                         f"({why}); use quant.backend=torch")
    return recoded


def check_peer_transform(transform_cfg, fmt: PeerFormat, codec) -> None:
    """A transform with a peer cache (transformers' QuantizedCache): it is fitted and reported against one of the
    project's formats, which the peer is not, so that format is named (transform.fit.format); a content codec
    re-encodes the project's int path and does not apply."""
    name = _plain(transform_cfg).get("name", "none")
    if codec is not None:
        raise ValueError(f"transform={name} stores content as format={codec}, a project codec; quant={fmt.name} is "
                         "transformers' own cache and takes no codec: use transform=quarot (or another kind) with it")
    fit = (_plain(transform_cfg).get("fit") or {}).get("format", "auto")
    if kinds(transform_cfg) != {"content": "none", "rope": "none"} and fit == "auto":
        raise ValueError(f"transform={name} with quant={fmt.name}: transforms are fitted and reported against one of "
                         f"the project's formats, and transformers' cache is none of them; name one: "
                         f"transform.fit.format={'int2_joint' if fmt.bits <= 2 else 'int4_joint'} (or another quant "
                         "option)")


def check_layered_transform(transform_cfg, quant_name: str, codec) -> None:
    """A transform with a format per layer: fitted transforms are fitted for one format, so it is named
    (transform.fit.format); a content codec re-encodes one int path for the whole model and does not apply."""
    name = _plain(transform_cfg).get("name", "none")
    if codec is not None:
        raise ValueError(f"transform={name} stores content as format={codec} in every layer; quant={quant_name} gives "
                         f"each layer its own format: use transform=quantmla (or another kind without a codec)")
    fit = (_plain(transform_cfg).get("fit") or {}).get("format", "auto")
    if kinds(transform_cfg) != {"content": "none", "rope": "none"} and fit == "auto":
        raise ValueError(f"transform={name} with quant={quant_name} (a format per layer): transforms are fitted "
                         f"and reported for one format; name it: transform.fit.format=int2_content_int4_rope (or another quant "
                         f"option), or give quant.budget as an option's name")


def fit_format(transform_cfg, run_format: CacheSpec | None, layer_dims: list[tuple[int, int]],
               groups: dict | None) -> CacheSpec:
    """The cache format the transforms are fitted for: transform.fit.format, `auto` = the run's quantized format,
    else int4_joint; at each MLA layer's (d_c, d_r) in `layer_dims` (a `CacheSpec` of one option where the
    layers' dims differ)."""
    from mla_quant.cache.bytes import load_quant_option

    name = (_plain(transform_cfg).get("fit") or {}).get("format", "auto")
    if name == "auto":
        if run_format is not None and not run_format.one_format:
            raise ValueError(f"quant={run_format.name} gives each layer its own format; the transforms are fitted and "
                             f"reported for one: name it, transform.fit.format=int2_content_int4_rope (or another "
                             f"quant option)")
        if run_format is not None and run_format.quantized:
            return run_format
        name = DEFAULT_FIT_FORMAT
    with warnings.catch_warnings():  # a RoPE part skipped on a model without a RoPE key: the run's format says so
        warnings.filterwarnings("ignore", message=".*no RoPE key.*")
        fmt = transformed_format(transform_cfg, model_format(load_quant_option(name, groups=groups), layer_dims))
    if not fmt.quantized:
        raise ValueError(f"transform.fit.format={name!r} stores both paths unquantized: nothing to fit against; "
                         f"name a quantized option (e.g. int4_joint)")
    return fmt


def fit_options(transform_cfg, seed: int) -> FitOptions:
    fit = _plain(transform_cfg).get("fit") or {}
    keys = ("steps", "lr", "alpha", "batch", "eval_every")
    return FitOptions(**{k: fit[k] for k in keys if k in fit}, seed=seed)
