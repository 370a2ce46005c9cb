"""Build MLA models: tiny random ones from a family's own config class, or real checkpoints via from_pretrained.

These are the `_target_`s of `conf/model/*.yaml`; `mla_quant.prepare.prepare_model(cfg)` builds the model through them.

    model = tiny_model("deepseek_v3", {"hidden_size": 64, ...})
    model = pretrained_model("deepseek_v2", hf_id="deepseek-ai/DeepSeek-V2-Lite", path="/data/ckpt/v2-lite")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mla_quant.models.absorbed import absorb
from mla_quant.models.families import family_for_config, get_family

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; allowed: {sorted(DTYPES)}") from None


def resolve_device(name: str) -> str:
    """auto -> cuda when a GPU is visible, else cpu; an explicit device is checked."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA GPU is visible; use device=cpu or device=auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device={name!r}; allowed: auto, cpu, cuda, cuda:N")
    return name


def _plain(config: Mapping | None) -> dict:
    """OmegaConf containers -> plain python (transformers configs must not hold DictConfig/ListConfig)."""
    if config is None:
        return {}
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with hydra, a hard dependency
        pass
    return dict(config)


def tiny_config(family: str, config: Mapping | None = None):
    """The family's own transformers config class, built from `config` (all fields overridable)."""
    fam = get_family(family)
    cfg = fam.config_class(**_plain(config))
    family_for_config(cfg)  # rejects configs without kv_lora_rank with a clear message
    return cfg


def tiny_model(
    family: str,
    config: Mapping | None = None,
    seed: int = 0,
    dtype: str = "float32",
    attn_implementation: str = "eager",
    absorbed: bool = True,
    device: str = "cpu",
) -> nn.Module:
    """A small randomly initialised model of `family`, seeded (the same seed gives the same weights)."""
    cfg = tiny_config(family, config)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)  # weights are drawn on the CPU, so a seed gives the same model on every device
    model = get_family(family).model_class(cfg).to(dtype=torch_dtype(dtype))
    model = model.to(resolve_device(device)).eval()
    return absorb(model) if absorbed else model


def pretrained_tokenizer(hf_id: str, revision: str | None = None, path: str | None = None):
    """The checkpoint's tokenizer (AutoTokenizer), from `path` if given; the same clear error as the weights."""
    from transformers import AutoTokenizer

    try:
        if path:
            return AutoTokenizer.from_pretrained(path)
        return AutoTokenizer.from_pretrained(hf_id, revision=revision)
    except OSError as err:
        raise _missing_checkpoint_error(hf_id, revision, path, err) from err


def load_tokenizer(model_cfg):
    """The tokenizer a model config names under `tokenizer` (a `_target_` node), or None (tiny random models)."""
    from hydra.utils import instantiate

    node = model_cfg.get("tokenizer")
    return None if node is None else instantiate(node)


def _missing_checkpoint_error(hf_id: str, revision: str | None, path: str | None, cause: Exception) -> OSError:
    where = f"model.path={path!r}" if path else "model.path is not set"
    return OSError(
        f"cannot load the checkpoint {hf_id!r} (revision {revision!r}): {where}, and it is not in the local "
        f"Hugging Face cache or the Hub cannot be reached. Download it, or point model.path at a local folder "
        f"holding config.json and the weights. ({type(cause).__name__}: {cause})"
    )


def pretrained_config(family: str, hf_id: str, revision: str | None = None, path: str | None = None,
                      config: Mapping | None = None):
    """The checkpoint's config (config.json only, no weights) as the family's config class, `config` overriding
    fields. Refuses a checkpoint that is not MLA or whose model_type belongs to another family."""
    fam = get_family(family)
    source = path or hf_id
    if path is not None and not Path(path).is_dir():
        raise OSError(f"model.path={path!r} is not a folder (checkpoint {hf_id!r}); give a folder with config.json")
    from transformers import PretrainedConfig

    kwargs = {} if path else {"revision": revision}
    try:
        raw, _ = PretrainedConfig.get_config_dict(source, **kwargs)
    except OSError as err:
        raise _missing_checkpoint_error(hf_id, revision, path, err) from err
    raw = raw.get("text_config", raw)
    if "kv_lora_rank" not in raw:
        arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
        raise ValueError(f"not an MLA model: {arch} at {source!r} has no kv_lora_rank")
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in fam.model_types:
        raise ValueError(f"model.family={family!r} but the checkpoint at {source!r} has model_type {model_type!r}; "
                         f"model types of {family!r}: {list(fam.model_types)}")
    # The family's own model_type (e.g. deepseek_v3 for Kimi-K2's "kimi_k2"): transformers picks its checkpoint
    # conversion (per-expert weights -> fused experts) by model_type, and a foreign one silently skips it.
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    return fam.config_class.from_dict({**fields, **_plain(config)})


def pretrained_model(
    family: str,
    hf_id: str,
    revision: str | None = None,
    path: str | None = None,
    dtype: str = "bfloat16",
    config: Mapping | None = None,
    attn_implementation: str = "eager",
    absorbed: bool = True,
    device_map: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A real checkpoint, loaded with the family's own transformers classes (no remote code needed).

    `path` (a local folder) wins over `hf_id`; `config` overrides fields of the checkpoint's config.
    """
    fam = get_family(family)
    source = path or hf_id
    kwargs = {} if path else {"revision": revision}
    hf_config = pretrained_config(family, hf_id, revision, path, config)
    model, info = fam.model_class.from_pretrained(
        source,
        config=hf_config,
        dtype=torch_dtype(dtype),
        attn_implementation=attn_implementation,
        device_map=device_map,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **kwargs,
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"checkpoint {source!r} does not fit {fam.model_class_name} ({len(missing)} weights missing, e.g. "
            f"{missing[:3]}): refusing to run with randomly initialised weights"
        )
    model.eval()
    return absorb(model) if absorbed else model
