"""Build MLA models: tiny random ones from a family's own config class, or real checkpoints via from_pretrained.

These are the `_target_`s of `conf/model/*.yaml`; `mla_quant.prepare.prepare_model(cfg)` builds the model through them.

    model = tiny_model("deepseek_v3", {"hidden_size": 64, ...})
    model = pretrained_model("deepseek_v2", hf_id="deepseek-ai/DeepSeek-V2-Lite", path="/data/ckpt/v2-lite")
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from mla_quant.models.absorbed import absorb
from mla_quant.models.families import family_for_config, get_family
from mla_quant.models.safetensors_files import SAFETENSORS_BYTES, check_safetensors  # noqa: F401 (re-exported)
from mla_quant.record import progress

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


def config_only(family: str, config: Mapping | None = None, **_):
    """A model YAML that holds a real checkpoint's config without its weights (conf/model/spec_*.yaml): its config is
    read (`tiny_config`), building it is refused."""
    raise ValueError(f"this model option holds the config of a {family} checkpoint only (no weights): experiments "
                     "that read a model's shape (experiment=serving) take it; for one that runs the model use the "
                     "checkpoint's option (e.g. model=deepseek_v3) or a tiny_* model")


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


# The files a local folder's tokenizer loads from, one set per kind (any one set suffices).
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("tiktoken.model",),
                   ("vocab.txt",))


def check_tokenizer_files(node) -> None:
    """A checkpoint tokenizer read from a local folder (model.tokenizer.path, model.path by default) must find its
    files there: else, before any weight is read, the folder, what was looked for and how to fix it (not, after the
    weights, that sentencepiece or tiktoken is missing). A tokenizer.model without tokenizer.json needs sentencepiece."""
    if node is None or node.get("_target_") != f"{__name__}.pretrained_tokenizer" or not node.get("path"):
        return
    folder = Path(str(node.get("path"))).expanduser()
    if not folder.is_dir():
        raise OSError(f"model.tokenizer.path={str(folder)!r} is not a folder; give the checkpoint's folder (with its "
                      f"tokenizer files)")
    names = {p.name for p in folder.iterdir()} | ({"tiktoken.model"} if any(folder.glob("*.tiktoken")) else set())
    found = next((kind for kind in TOKENIZER_FILES if set(kind) <= names), None)
    if found is None:
        wanted = ", ".join(" + ".join(kind) for kind in TOKENIZER_FILES)
        config = "there" if "tokenizer_config.json" in names else "missing too"
        raise OSError(f"model.tokenizer.path={str(folder)!r} has no tokenizer files (looked for one of: {wanted}, or "
                      f"*.tiktoken; tokenizer_config.json is {config}). Copy them from the checkpoint's repository "
                      f"into the folder, or set model.tokenizer.path to a folder that has them")
    if found == ("tokenizer.model",):
        import importlib.util

        if importlib.util.find_spec("sentencepiece") is None:
            raise OSError(f"model.tokenizer.path={str(folder)!r} has a SentencePiece tokenizer.model and no "
                          f"tokenizer.json: pip install sentencepiece (or add the checkpoint's tokenizer.json)")


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
    text = raw.get("text_config", raw)  # a multimodal wrapper's text decoder holds the MLA fields
    if "kv_lora_rank" not in text:
        arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
        raise ValueError(f"not an MLA model: {arch} at {source!r} has no kv_lora_rank")
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in fam.model_types:
        raise ValueError(f"model.family={family!r} but the checkpoint at {source!r} has model_type {model_type!r}; "
                         f"model types of {family!r}: {list(fam.model_types)}")
    # The family's own model_type (e.g. deepseek_v3 for Kimi-K2's "kimi_k2"): transformers picks its checkpoint
    # conversion (per-expert weights -> fused experts) by model_type, and a foreign one silently skips it.
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    return fam.config_class.from_dict(_merged(fields, _plain(config)))


def _merged(base: dict, override: dict) -> dict:
    """`base` with `override`'s fields, nested dicts (a wrapper's text_config) merged field by field."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def checkpoint_files(hf_id: str, revision: str | None, path: str | None) -> list[Path] | None:
    """The checkpoint's weight files: those of `path`, or of its Hugging Face cache snapshot; None when the
    checkpoint is not on this machine yet (from_pretrained will download it)."""
    folder = Path(path) if path else None
    if folder is None:
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(hf_id, revision=revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached (or no such repo): nothing local to check yet
            return None
    return sorted(f for f in folder.iterdir() if f.name.endswith(WEIGHT_SUFFIXES) and f.is_file())


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)  # hashlib drops the GIL on large blocks: files hash in parallel threads
    return h.hexdigest()


def verify_weight_files(files: list[Path], expected: Mapping[str, str] | None = None) -> dict[str, str]:
    """SHA-256 of every weight file, checked against `expected` (`model.sha256`: file name -> hex digest) or, for a
    file in the Hugging Face cache, against the content hash its blob is named by. -> {file name: sha256}."""
    expected = {k: str(v).lower() for k, v in _plain(expected).items()}
    unknown = sorted(set(expected) - {f.name for f in files})
    if unknown:
        raise ValueError(f"model.sha256 names {unknown}, which are not weight files of the checkpoint; its weight "
                         f"files: {[f.name for f in files]}")
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        digests = dict(zip([f.name for f in files], pool.map(sha256_file, files)))
    for f in files:
        blob = Path(os.path.realpath(f)).name
        want = expected.get(f.name) or (blob if _SHA256.fullmatch(blob) else None)
        if want is not None and digests[f.name] != want:
            source = "model.sha256" if f.name in expected else "the Hugging Face cache's blob name"
            raise ValueError(f"weight file {f} has SHA-256 {digests[f.name]} but {source} says {want}: the file is "
                             f"corrupted or incompletely downloaded; delete it and download it again")
    return digests


def check_finite(model: nn.Module, source: str) -> None:
    """Refuse loaded weights holding NaN or inf (offloaded tensors on the meta device are not read)."""
    bad = [name for name, t in model.state_dict().items()
           if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"checkpoint {source!r}: {len(bad)} weight tensor(s) hold NaN or inf, e.g. {bad[:3]}; "
                         f"refusing to run with them")


def partial_fp8_blocks(config, files: list[Path] | None) -> str | None:
    """Where transformers would dequantize a block-FP8 checkpoint on load (no GPU, or one below compute capability
    8.9, runs FP8), the first weight that ends in a partial block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in
    blocks of 128), described; None otherwise. transformers' dequantizer (5.25) needs whole blocks and fails there."""
    from mla_quant.models.fp8 import block_fp8_config

    qc = block_fp8_config(config)
    if qc is None or not qc.get("weight_block_size") or not files:
        return None
    # transformers' own rule (its FP8 quantizer's validate_environment): FP8 is kept wherever a GPU that runs it is
    # present, whatever the device_map; only then does it not dequantize
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and not qc.get("dequantize"):
        return None
    bn, bk = qc["weight_block_size"]
    for file in files:
        if not file.name.endswith(".safetensors"):
            continue
        header = check_safetensors(file)
        for key in header:
            if key.endswith(".weight_scale_inv") and key.removesuffix("_scale_inv") in header:
                rows, cols = header[key.removesuffix("_scale_inv")]["shape"][-2:]
                if rows % bn or cols % bk:
                    return f"{key.removesuffix('_scale_inv')} is {rows} x {cols}, not whole blocks of {[bn, bk]}"
    return None


def streamed_model(model_cfg, device: str, blocks=None):
    """The `StreamedModel` of a checkpoint model YAML (`pretrained_model`'s settings, model.path a local folder),
    checked first (`check_streaming`)."""
    from mla_quant.models.streaming import StreamedModel, check_streaming

    check_streaming(model_cfg)
    config = pretrained_config(model_cfg.family, model_cfg.hf_id, model_cfg.get("revision"), model_cfg.path,
                               model_cfg.get("config"))
    config._attn_implementation = model_cfg.get("attn_implementation") or "eager"
    return StreamedModel(get_family(model_cfg.family).model_class, config, model_cfg.path, torch_dtype(model_cfg.dtype),
                         device, blocks, host_gb=float(model_cfg.get("streaming_host_gb", 8.0)))


def read_layer_by_layer(fam, config, folder: Path, dtype: str, device_map, why: str) -> nn.Module:
    """The whole checkpoint read into memory one decoder layer at a time through the streamed model's loading
    (`StreamedModel.materialize`: block-FP8 pairs dequantized with the project's accessor), where transformers'
    loading cannot read it (`why`). On one device: `device_map` null/cpu (or auto without a GPU), or one device."""
    from mla_quant.models.streaming import StreamedModel

    if device_map == "auto" and torch.cuda.is_available():
        raise ValueError(f"{why}: transformers cannot dequantize a partial FP8 block on load, which it does without a "
                         "GPU that runs FP8 (compute capability >= 8.9), and model.device_map=auto would need it. "
                         "Give one device (model.device_map=cuda:0), or stream it (model.streaming=true)")
    device = "cpu" if device_map in (None, "cpu", "auto") else str(device_map)
    warnings.warn(f"{why}: transformers cannot dequantize a partial FP8 block on load; the checkpoint is read one "
                  "decoder layer at a time and dequantized by the project's own accessor instead", stacklevel=3)
    stream = StreamedModel(fam.model_class, config, folder, torch_dtype(dtype), device, prefetch=False,
                           absorbed=False)
    try:
        return stream.materialize()
    finally:
        stream.close()


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
    sha256: Mapping[str, str] | None = None,
    streaming: bool = False,
    streaming_host_gb: float = 8,
) -> nn.Module:
    """A real checkpoint, loaded with the family's own transformers classes (no remote code needed).

    `path` (a local folder) wins over `hf_id`; `config` overrides fields of the checkpoint's config. The weight
    files are checked against their hashes (`verify_weight_files`; before loading when they are on this machine)
    and the loaded weights for NaN/inf; the files' SHA-256 go into the run record (`weights`).
    """
    fam = get_family(family)
    source = path or hf_id
    kwargs = {} if path else {"revision": revision}
    on_cpu = device_map in (None, "cpu") or (device_map == "auto" and not torch.cuda.is_available())
    if on_cpu and dtype in ("bfloat16", "float16"):
        warnings.warn(f"model.dtype={dtype} on the CPU: its matmuls run ~30x slower than float32 there; for a CPU "
                      "run use model.dtype=float32", stacklevel=2)
    hf_config = pretrained_config(family, hf_id, revision, path, config)
    files = checkpoint_files(hf_id, revision, path)
    hashes = verify_weight_files(files, sha256) if files is not None else None
    partial = partial_fp8_blocks(hf_config, files)
    if partial is not None:
        model = read_layer_by_layer(fam, hf_config, files[0].parent, dtype, device_map, partial)
        check_finite(model, source)
        progress().note("weights", hashes)
        return absorb(model) if absorbed else model
    model, info = fam.model_class.from_pretrained(
        source,
        config=hf_config,
        dtype=torch_dtype(dtype),
        attn_implementation=attn_implementation,
        device_map=device_map,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        # transformers >= 5.25 swaps modules (RMSNorm, MoE, ...) for Hub kernels after loading when `kernels` is
        # installed, fetching them online: the study runs the modeling code as written, the same on every device
        use_kernels=False,
        **kwargs,
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"checkpoint {source!r} does not fit {fam.model_class_name} ({len(missing)} weights missing, e.g. "
            f"{missing[:3]}): refusing to run with randomly initialised weights"
        )
    if hashes is None:  # downloaded by from_pretrained just now: check what landed in the cache
        hashes = verify_weight_files(checkpoint_files(hf_id, revision, path) or [], sha256)
    check_finite(model, source)
    progress().note("weights", hashes)
    model.eval()
    return absorb(model) if absorbed else model
