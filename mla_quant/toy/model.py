"""The toy MLA model: its config (transformers' DeepseekV2 with MLA's ratios) and the loader of the shipped weights.

Shape of the toy (TOY_CONFIG, ~2M parameters): hidden 192, 4 layers, 4 heads; per head q/k = 32 content + 16 decoupled RoPE dims,
v = 32; the latent c_kv is d_c = 96 wide (3x one head's content key, as DeepSeek-V2's 512 is 4x its 128), the
RoPE key d_r = 16 (half a head, as 64 of 128); dense MLP in every layer. Byte-level BPE of 1024 tokens
(mla_quant.toy.tokenizer), 1024 positions.

    model = load_toy_model()                 # absorbed MLA, float32, from mla_quant/toy/assets/ (conf/model/toy_mla.yaml)
    tok = load_toy_tokenizer()
    model = load_toy_model(path="outputs/train_toy/<run>/model", absorbed=False)

The loader never falls back to random weights: a missing file, a checksum that differs from TRAINING.json, or a
state dict that does not match the config raises `ToyCheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

ASSETS = Path(__file__).resolve().parent / "assets"
WEIGHTS, CONFIG, TRAINING = "model.safetensors", "config.json", "TRAINING.json"

TOY_CONFIG = dict(
    vocab_size=1024,  # mla_quant.toy.tokenizer.VOCAB_SIZE
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=96,
    q_lora_rank=None,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=1024,
    first_k_dense_replace=4,  # = num_hidden_layers: dense MLP everywhere
    n_routed_experts=4,  # unused (no MoE layer) but the config needs consistent MoE fields
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


class ToyCheckpointError(OSError):
    """The shipped (or given) toy checkpoint is missing, corrupted or does not match its config."""


def toy_config(overrides: dict | None = None):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**{**TOY_CONFIG, **(overrides or {})})


def new_toy_model(config=None, seed: int = 0, attn_implementation: str = "sdpa") -> nn.Module:
    """A freshly initialised (untrained) toy model, for training."""
    from transformers import DeepseekV2ForCausalLM

    config = config or toy_config()
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _require(path: Path) -> Path:
    if not path.is_file():
        raise ToyCheckpointError(f"toy checkpoint file missing: {path} (re-run `python run.py experiment=train_toy "
                                 f"task.ship=true` or restore it from git)")
    return path


def load_toy_state(folder: str | Path | None = None):
    """(config, state_dict, training record) of a toy checkpoint folder, with every check applied."""
    from safetensors.torch import load_file
    from transformers import DeepseekV2Config

    folder = Path(folder) if folder else ASSETS
    weights, config_file = _require(folder / WEIGHTS), _require(folder / CONFIG)
    record = {}
    if (folder / TRAINING).is_file():
        record = json.loads((folder / TRAINING).read_text())
        expected = record.get("weights_sha256")
        if expected and sha256_of(weights) != expected:
            raise ToyCheckpointError(f"toy checkpoint file corrupted: {weights} has a SHA-256 different from the "
                                     f"one recorded in {folder / TRAINING} ({expected[:12]}...)")
    try:
        config = DeepseekV2Config.from_json_file(str(config_file))
    except (ValueError, json.JSONDecodeError) as err:
        raise ToyCheckpointError(f"toy checkpoint file corrupted: {config_file} ({err})") from err
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise ToyCheckpointError(f"toy checkpoint file corrupted: {weights} ({type(err).__name__}: {err})") from err
    return config, state, record


def load_toy_config(folder: str | Path | None = None):
    """The toy checkpoint's config (config.json only, no weights)."""
    from transformers import DeepseekV2Config

    config_file = _require((Path(folder) if folder else ASSETS) / CONFIG)
    try:
        return DeepseekV2Config.from_json_file(str(config_file))
    except (ValueError, json.JSONDecodeError) as err:
        raise ToyCheckpointError(f"toy checkpoint file corrupted: {config_file} ({err})") from err


def load_toy_model(path: str | Path | None = None, dtype: str = "float32", attn_implementation: str = "eager",
                   absorbed: bool = True, device: str = "cpu", family: str = "deepseek_v2") -> nn.Module:
    """The trained toy model (from mla_quant/toy/assets/ unless `path` is given), absorbed like every builder's."""
    from transformers import DeepseekV2ForCausalLM

    if family != "deepseek_v2":
        raise ValueError(f"model.family={family!r}: the toy model is a DeepSeek-V2 (family deepseek_v2)")

    from mla_quant.models.absorbed import absorb
    from mla_quant.models.build import resolve_device, torch_dtype

    config, state, _ = load_toy_state(path)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        folder = Path(path) if path else ASSETS
        raise ToyCheckpointError(f"toy checkpoint {folder / WEIGHTS} does not match {folder / CONFIG}: {err}") from err
    # Non-persistent buffers (RoPE inv_freq) are not in the state dict: rebuild them on the real device.
    rotary = type(model.model.rotary_emb)(config=config)
    model.model.rotary_emb = rotary
    model = model.to(device=resolve_device(device), dtype=torch_dtype(dtype)).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return absorb(model) if absorbed else model


def load_toy_tokenizer(path: str | Path | None = None):
    """The shipped byte-level BPE tokenizer (AutoTokenizer over the assets folder, offline)."""
    from transformers import AutoTokenizer

    folder = Path(path) if path else ASSETS
    _require(folder / "tokenizer.json")
    return AutoTokenizer.from_pretrained(str(folder))


def save_toy_checkpoint(model: nn.Module, folder: str | Path, record: dict) -> Path:
    """Write model.safetensors + config.json + tokenizer + TRAINING.json (with the weights' SHA-256)."""
    from safetensors.torch import save_file

    from mla_quant.record import write_json_atomic
    from mla_quant.toy.tokenizer import save_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    model.config.to_json_file(str(folder / CONFIG))
    save_tokenizer(folder)
    write_json_atomic(folder / TRAINING, {**record, "weights_sha256": sha256_of(folder / WEIGHTS)})
    return folder
