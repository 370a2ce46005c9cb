"""Prefill benchmark: peak memory and time of one absorbed layer's prefill, blocked (latent and expanded forms)
against the unblocked reference, side by side in one run, at real attention dimensions.

    python run.py experiment=bench_prefill                                  # V2-Lite (16 heads) and V3 (128 heads) dims
    python run.py experiment=bench_prefill attention.query_block=128 'task.contexts.v2_lite=[2048,8192]'
    python run.py experiment=bench_prefill device=cuda task.dtype=bfloat16 'task.contexts.v2_lite=[32768]'

For each model of `task.models` (one decoder layer of a family's real attention config, random weights) and each
context T: the whole forward of a batch of `task.batch_size` prompts of T tokens, the first row left-padded by
`task.left_pad` (so the attention gets a mask), in the forms of `task.forms` measured alternately, `task.repeats`
times each:
- `unblocked`: every (H, T, S) score at once and transformers' eager (B, 1, T, S) additive mask, as the absorbed
  path ran before it was blocked;
- `blocked`: the configured `attention` blocks and the compact causal mask (docs/method.md section 1), in the latent
  form (the option's expand_from left out);
- `expanded`: the same query blocks in the expanded form (per-head K/V and scaled_dot_product_attention; the
  option's expand_from, or 1 when it has none).
The reference is skipped where its scores alone would exceed `task.reference_budget_gb`. Reports peak added memory
(the bytes allocated: CUDA's allocator, or on the CPU the C allocator's bytes in use, mla_quant.memory; the CPU's
resident set beside it, which also keeps freed memory the allocator holds on to), seconds (the fastest repeat), their
ratios, the growth of each blocked form's memory between every two contexts, and the largest relative difference of
the outputs.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, open_dict
from tqdm.auto import tqdm

from mla_quant.kernels.attention import UNBLOCKED
from mla_quant.memory import PeakMemory
from mla_quant.models.absorbed import absorb, attention_blocks, latent_dims
from mla_quant.models.families import text_config
from mla_quant.prepare import build_model
from mla_quant.record import write_text_atomic
from mla_quant.stages import StageResult, selected_models

GB = 1e9


def _inputs(vocab: int, batch: int, tokens: int, left_pad: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    return ids.to(device), mask.to(device)


@torch.no_grad()
def _measure(model, ids, mask, device) -> tuple[PeakMemory, torch.Tensor]:
    gc.collect()
    with PeakMemory(device) as mem:
        out = model.model(ids, attention_mask=mask, use_cache=False).last_hidden_state
    return mem, out


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    names = selected_models(task)
    missing = sorted(set(names) - set(task.contexts))
    if missing:
        raise ValueError(f"task.contexts has no contexts for {missing}; it has {sorted(task.contexts)}")
    blocks = attention_blocks(cfg.get("attention"))
    if not blocks.blocked:
        raise ValueError("experiment=bench_prefill compares the blocked attention against the unblocked one: "
                         "attention=unblocked leaves nothing to compare; use attention=blocked or expanded")
    known = {"blocked": dataclasses.replace(blocks, expand_from=None),
             "expanded": dataclasses.replace(blocks, expand_from=blocks.expand_from or 1), "unblocked": UNBLOCKED}
    chosen = list(task.forms)
    bad = [f for f in chosen if f not in known]
    if bad or "unblocked" not in chosen or len(chosen) < 2:
        raise ValueError(f"task.forms={chosen}: the unblocked reference and at least one of blocked, expanded "
                         f"(allowed: {list(known)})")
    compared = [f for f in chosen if f != "unblocked"]
    rows, metrics = [], {}
    for name in names:
        model_cfg = task.models[name].copy()
        with open_dict(model_cfg):
            model_cfg.dtype = task.dtype
        model = build_model(model_cfg, absorbed=False).eval()
        device = next(model.parameters()).device
        dims = latent_dims(absorb(model))
        attn = model.mla_family.attention_modules(model)[0]
        heads = attn.num_heads
        contexts = sorted(int(c) for c in task.contexts[name])
        text = text_config(model.config)
        too_long = [c for c in contexts if c > text.max_position_embeddings]
        if too_long:
            raise ValueError(f"task.contexts.{name}={too_long} exceed the model's {text.max_position_embeddings}"
                             " positions")
        element = torch.finfo(next(model.parameters()).dtype).bits // 8
        warm_ids, warm_mask = _inputs(text.vocab_size, task.batch_size, 64, task.left_pad, device, cfg.seed)
        for form in chosen:  # lazy initialisation and allocator warm-up outside the measurements
            absorb(model, known[form])
            _measure(model, warm_ids, warm_mask, device)
        for ctx in tqdm(contexts, desc=f"bench_prefill {name}", unit="context"):
            ids, mask = _inputs(text.vocab_size, task.batch_size, ctx, task.left_pad, device, cfg.seed)
            # scores, their float32 softmax and the probabilities: what the unblocked form holds at once
            reference_gb = task.batch_size * heads * ctx * ctx * (2 * element + 4) / GB
            forms = {f: known[f] for f in compared}
            if reference_gb <= task.reference_budget_gb:
                forms["unblocked"] = UNBLOCKED
            best, outs = {}, {}
            for _ in range(task.repeats):
                for form, form_blocks in forms.items():
                    absorb(model, form_blocks)
                    if form == "unblocked":  # the mask the absorbed path was handed before: eager's (B, 1, T, S)
                        model.config._attn_implementation = "eager"
                    mem, outs[form] = _measure(model, ids, mask, device)
                    added = mem.added_bytes if mem.added_allocated_bytes is None else mem.added_allocated_bytes
                    prev = best.get(form, (float("inf"), 0, 0))
                    best[form] = (min(prev[0], mem.seconds), max(prev[1], added), max(prev[2], mem.added_bytes))
            absorb(model, blocks)
            valid = mask.bool()
            diff = {}
            if "unblocked" in outs:
                ref = outs["unblocked"][valid]
                diff = {f: float((outs[f][valid] - ref).abs().max() / ref.abs().max()) for f in compared}
            for form, (seconds, added, resident) in best.items():
                rows.append({"model": name, "heads": heads, "d_c": dims["d_c"], "d_r": dims["d_r"], "context": ctx,
                             "form": form, "peak_added_gb": added / GB, "resident_added_gb": resident / GB,
                             "seconds": seconds, "max_rel_diff": diff.get(form)})
                metrics[f"bench/prefill/{name}/ctx{ctx}/{form}/peak_added_gb"] = added / GB
                metrics[f"bench/prefill/{name}/ctx{ctx}/{form}/resident_added_gb"] = resident / GB
                metrics[f"bench/prefill/{name}/ctx{ctx}/{form}/seconds"] = seconds
            for form in compared if "unblocked" in best else ():
                metrics[f"bench/prefill/{name}/ctx{ctx}/memory_ratio_{form}_vs_unblocked"] = (
                    best[form][1] / max(best["unblocked"][1], 1))
                metrics[f"bench/prefill/{name}/ctx{ctx}/speed_{form}_vs_unblocked"] = (
                    best["unblocked"][0] / best[form][0])
                metrics[f"bench/prefill/{name}/ctx{ctx}/{form}/max_rel_diff"] = diff[form]
            if "blocked" in best and "expanded" in best:
                metrics[f"bench/prefill/{name}/ctx{ctx}/speed_expanded_vs_blocked"] = (
                    best["blocked"][0] / best["expanded"][0])
            del ids, mask, outs
        for form in compared:
            peak = {r["context"]: r["peak_added_gb"] for r in rows if r["model"] == name and r["form"] == form}
            ctxs = sorted(peak)
            for lo, hi in itertools.combinations(ctxs, 2):
                metrics[f"bench/prefill/{name}/{form}/growth_ctx{lo}_to_ctx{hi}"] = peak[hi] / max(peak[lo], 1e-9)
        del model
        gc.collect()

    table = pd.DataFrame(rows)
    write_text_atomic(run_dir / "bench_prefill.csv", table.to_csv(index=False))
    text = table.to_markdown(index=False, floatfmt=".3g")
    write_text_atomic(run_dir / "bench_prefill.md", f"blocks {blocks}, {task.dtype}, batch {task.batch_size}\n\n"
                                                    f"{text}\n")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    for key, value in metrics.items():
        if "ratio" in key or "speed_" in key or "growth" in key or "rel_diff" in key:
            print(f"{key}: {value:.3g}")
    return StageResult(metrics=metrics, tables={"bench_prefill": table})
