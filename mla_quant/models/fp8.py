"""Block-FP8 checkpoints (DeepSeek-V3/V3.2, Kimi-K2): the MLA weights read through one accessor.

These checkpoints store each linear's weight in float8 (e4m3) with a float32 scale per [128, 128] block
(`quantization_config`: `quant_method: fp8`, `weight_block_size`); on a GPU transformers loads them as `FP8Linear`,
whose `weight` holds the codes and `weight_scale_inv` the block scales (the weight is codes x scale). Everything
that reads an MLA weight as a matrix (the absorbed attention's W_UK / W_UV, the folds, calibration, export) goes
through `weight_of`; the MLA projections run through `linear`, which calls the module (its FP8 kernel) on a GPU
and multiplies by the dequantized weight elsewhere (transformers' FP8 kernel needs CUDA).

    w = weight_of(attn.kv_b_proj)                # (out, in) full precision, whatever the module stores
    y = linear(attn.q_a_proj, x)
    dense(attn, ["kv_b_proj"], torch.bfloat16)   # replace FP8 modules by full-precision nn.Linear (before a fold)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

# The quantization_config DeepSeek-V3 and Kimi-K2 ship (with their weight_block_size).
FP8_CHECKPOINT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n))
# The MLA projections a fold may rewrite (content: kv_a, kv_b; RoPE: kv_a, the query's output projection).
MLA_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "q_gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def is_fp8(module) -> bool:
    """A linear whose weight holds float8 codes with a `weight_scale_inv` beside it (transformers' FP8Linear)."""
    weight = getattr(module, "weight", None)
    return weight is not None and weight.dtype in FP8_DTYPES and hasattr(module, "weight_scale_inv")


def block_size(module) -> tuple[int, int] | None:
    size = getattr(module, "block_size", None)
    return None if size is None else (int(size[0]), int(size[1]))


def scale_shape(shape: tuple[int, int], size) -> tuple[int, int]:
    """The block-scale grid of a weight (out, in): ceil(out / bn) x ceil(in / bk) (a last partial block keeps its
    own scale: DeepSeek-V3's kv_a_proj_with_mqa has 576 rows in blocks of 128)."""
    return -(-shape[0] // size[0]), -(-shape[1] // size[1])


def check_block_size(name: str, size) -> tuple[int, int]:
    """A weight_block_size must be two positive integers; ValueError naming the value."""
    ok = (isinstance(size, (list, tuple)) and len(size) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size))
    if not ok:
        raise ValueError(f"{name}: FP8 weight_block_size={size!r}; expected two positive integers [rows, columns] "
                         "(DeepSeek-V3 and Kimi-K2: [128, 128])")
    return int(size[0]), int(size[1])


def dequantize(module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-precision weight (out, in) of an FP8 linear: codes x their block's scale, in `dtype`."""
    return dequantize_blocks(module.weight, module.weight_scale_inv, block_size(module), dtype, type(module).__name__)


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, size, dtype: torch.dtype = torch.float32,
                      what: str = "weight") -> torch.Tensor:
    """Block-FP8 codes (out, in) x the float32 scale of their [bn, bk] block (a last partial block keeps its own
    scale: DeepSeek-V3's kv_a_proj_with_mqa, 576 rows in blocks of 128), in `dtype`. `size` None, or a single
    scale: one scale for the whole weight."""
    scale = scale.float()
    w = codes.float()
    if size is None or scale.numel() == 1:
        return (w * scale.reshape(())).to(dtype)
    bn, bk = check_block_size(what, list(size))
    out, inp = w.shape
    if tuple(scale.shape) != scale_shape((out, inp), (bn, bk)):
        raise ValueError(f"{what}: FP8 weight_scale_inv has shape {list(scale.shape)}, expected "
                         f"{list(scale_shape((out, inp), (bn, bk)))} for a weight of shape {[out, inp]} in blocks of "
                         f"{[bn, bk]}")
    full = scale.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp]  # (out, in)
    return (w * full).to(dtype)


def weight_of(module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight of a linear as a full-precision matrix: the parameter itself (no copy) for a plain linear, the
    dequantized weight (float32 unless `dtype`) for an FP8 one."""
    if is_fp8(module):
        return dequantize(module, dtype or torch.float32)
    return module.weight if dtype is None else module.weight.to(dtype)


def linear(module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for any linear; an FP8 one off the GPU multiplies by its dequantized weight in x's dtype."""
    if not is_fp8(module) or module.weight.is_cuda:
        return module(x)
    return F.linear(x, dequantize(module, x.dtype), None if module.bias is None else module.bias.to(x.dtype))


def quantize_blocks(weight: torch.Tensor, size: tuple[int, int] = (128, 128), dtype=None):
    """(codes, scale_inv): block-FP8 codes of a weight and the float32 scale per block (amax / 448), as the
    checkpoints store them. For tests and small checkpoints; the inverse of `dequantize`."""
    dtype = dtype or FP8_DTYPES[0]
    out, inp = weight.shape
    bn, bk = check_block_size("weight", list(size))
    gn, gk = scale_shape((out, inp), (bn, bk))
    padded = weight.float().new_zeros(gn * bn, gk * bk)
    padded[:out, :inp] = weight.float()
    blocks = padded.reshape(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(dtype).max  # (gn, gk)
    codes = (blocks / scale[:, None, :, None]).reshape(gn * bn, gk * bk)[:out, :inp].to(dtype)
    return codes, scale


def dense(parent: nn.Module, names: Iterable[str], dtype: torch.dtype) -> list[str]:
    """Replace each FP8 linear `parent.<name>` by an nn.Linear holding its dequantized weight in `dtype` (what a fold
    rewrites must be full precision). Returns the names replaced."""
    done = []
    for name in names:
        module = getattr(parent, name, None)
        if module is None or not is_fp8(module):
            continue
        full = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                         device=module.weight.device, dtype=dtype)
        with torch.no_grad():
            full.weight.copy_(dequantize(module, dtype))
            if module.bias is not None:
                full.bias.copy_(module.bias.to(dtype))
        setattr(parent, name, full)
        done.append(name)
    return done


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its input embeddings' (FP8 checkpoints keep them in bf16)."""
    return model.get_input_embeddings().weight.dtype


def quantization_config(config) -> dict | None:
    """A checkpoint config's `quantization_config` as a dict (None: a full-precision checkpoint)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, Mapping) else qc.to_dict()


def block_fp8_config(config) -> dict | None:
    """The `quantization_config` of a block-FP8 checkpoint (quant_method fp8) as a dict; None for any other."""
    qc = quantization_config(config)
    return qc if qc is not None and qc.get("quant_method") == "fp8" else None


def check_fp8_config(config) -> None:
    """A checkpoint config's block-FP8 `quantization_config`, checked before any weight is read: fp8 with a
    weight_block_size of two positive integers."""
    qc = block_fp8_config(config)
    if qc is None:
        return
    if qc.get("weight_block_size") is not None:
        check_block_size("quantization_config", qc["weight_block_size"])
