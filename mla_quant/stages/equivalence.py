"""Equivalence: the absorbed latent-cache path against the untouched transformers model, for every MLA family.

    python run.py experiment=equivalence

For each model of `task.models` (tiny random models of every family, float32, eager attention), with the family's
RoPE scaling as configured and switched off, without and with left padding: max |logit difference| on a prefill and
over greedy decode steps (the absorbed model decoding from a LatentCache, the reference from transformers' default
cache), whether the greedy tokens are identical, and the bytes the latent cache holds per token per layer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import torch

from omegaconf import DictConfig
from tqdm.auto import tqdm

from mla_quant.models.absorbed import absorb, cache_kwargs, latent_dims, new_cache
from mla_quant.models.families import get_family, text_config
from mla_quant.prepare import build_model
from mla_quant.stages import StageResult, selected_models, stage_models
from mla_quant.record import write_text_atomic


def rope_variants(model_cfg: DictConfig) -> dict[str, DictConfig]:
    """The configured RoPE, plus plain RoPE when the configured one is scaled (YaRN, LongRoPE) and the family's
    transformers code runs plain RoPE at all (`MLAFamily.plain_rope`)."""
    variants = {"configured": model_cfg}
    rope = model_cfg.config.get("rope_parameters")
    if rope is not None and rope.get("rope_type", "default") != "default" and get_family(model_cfg.family).plain_rope:
        plain = copy.deepcopy(model_cfg)
        plain.config.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
        variants = {f"rope_{rope.rope_type}": model_cfg, "rope_default": plain}
    return variants


def make_batch(vocab_size: int, batch_size: int, tokens: int, left_pad: int, seed: int):
    """Random ids (avoiding the low special ids) and an attention mask; row 0 is left-padded by `left_pad`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch_size, tokens), generator=g)
    mask = torch.ones_like(ids)
    if left_pad:
        ids[0, :left_pad] = 0
        mask[0, :left_pad] = 0
    return ids, mask


@torch.no_grad()
def compare(reference, absorbed, ids, mask, decode_steps: int) -> dict[str, float]:
    """Logit differences (valid positions only), greedy-token agreement and cache bytes for one batch."""
    valid = mask.bool()
    ref = reference(ids, attention_mask=mask).logits
    cache = new_cache(absorbed)
    out = absorbed(ids, attention_mask=mask, **cache_kwargs(cache)).logits
    prefill = (ref - out).abs()[valid].max().item()
    bytes_per_token = cache.bytes_per_token_per_layer()

    gen = dict(max_new_tokens=decode_steps, min_new_tokens=decode_steps, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0, attention_mask=mask)
    g_ref = reference.generate(ids, **gen)
    g_abs = absorbed.generate(ids, **cache_kwargs(new_cache(absorbed)), **gen)
    decode = max((a - b).abs().max().item() for a, b in zip(g_ref.logits, g_abs.logits))
    return {
        "prefill_max_abs_logit_diff": prefill,
        "decode_max_abs_logit_diff": decode,
        "greedy_tokens_match": float(torch.equal(g_ref.sequences, g_abs.sequences)),
        "cache_bytes_per_token_per_layer": bytes_per_token,
        "logit_scale": ref[valid].abs().max().item(),
    }


def check_model(model_cfg: DictConfig, *, prefill_tokens: int, decode_steps: int, batch_size: int, left_pad: int,
                seed: int) -> dict[str, dict[str, float]]:
    """All variants for one model config: {"<rope>/<padding>": metrics}."""
    results = {}
    for rope_name, cfg in rope_variants(model_cfg).items():
        reference = build_model(cfg, absorbed=False, attn_implementation="eager", dtype="float32")
        absorbed = absorb(copy.deepcopy(reference))
        vocab = text_config(reference.config).vocab_size
        for pad_name, pad in (("no_padding", 0), ("left_padding", left_pad)):
            ids, mask = (t.to(reference.device) for t in make_batch(vocab, batch_size, prefill_tokens, pad, seed))
            metrics = compare(reference, absorbed, ids, mask, decode_steps)
            layer_dims = latent_dims(absorbed)["layer_dims"]  # the mean over MLA layers, whose dims may differ
            metrics["latent_values_per_token_per_layer"] = sum(c + r for c, r in layer_dims) / len(layer_dims)
            results[f"{rope_name}/{pad_name}"] = metrics
    return results


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    models = stage_models(cfg)
    names = selected_models(task, models)

    metrics, rows = {}, []
    for name in tqdm(names, desc="equivalence", unit="family"):
        results = check_model(
            models[name],
            prefill_tokens=task.prefill_tokens,
            decode_steps=task.decode_steps,
            batch_size=task.batch_size,
            left_pad=task.left_pad,
            seed=cfg.seed,
        )
        worst = 0.0
        all_match = True
        for variant, m in results.items():
            for key, value in m.items():
                metrics[f"equivalence/{name}/{variant}/{key}"] = value
            worst = max(worst, m["prefill_max_abs_logit_diff"], m["decode_max_abs_logit_diff"])
            all_match &= m["greedy_tokens_match"] == 1.0
            rows.append({"model": name, "family": models[name].family, "variant": variant, **m})
        passed = worst <= task.tolerance and all_match
        metrics[f"equivalence/{name}/max_abs_logit_diff"] = worst
        metrics[f"equivalence/{name}/passed"] = passed

    failed = [n for n in names if not metrics[f"equivalence/{n}/passed"]]
    metrics["equivalence/all_passed"] = not failed
    table = pd.DataFrame(rows)
    text = table.to_markdown(index=False, floatfmt=".3g")
    write_text_atomic(run_dir / "equivalence.md", f"tolerance {task.tolerance:g}\n\n{text}\n")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    message = f"not equivalent within {task.tolerance:g}: {failed}" if failed else ""
    return StageResult(metrics=metrics, ok=not failed, message=message)

