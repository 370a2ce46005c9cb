"""Stage: perplexity and next-token KL of a cache format against the unquantized cache (the quick quality check).

    python run.py experiment=quality quant=int2_content_int4_rope
    python run.py experiment=quality quant=int4_joint transform=quantmla
    python run.py experiment=quality model=deepseek_v2_lite quant=int4_joint          # WikiText-2 test split

The same prepared model (transform folded, absorbed) scores held-out sequences twice: over a fresh unquantized latent
cache (the reference: a fitted transform leaves the function unchanged, so this is the original model) and over a
fresh cache in the configured format. Per scored token (on the toy's documents the
answers it was trained to predict, on text every token): the negative log-likelihood of the next token under each,
KL(reference || quantized) of the next-token distributions and whether their top-1 tokens agree. Metrics:
quality/ppl, quality/ppl_unquantized, quality/ppl_ratio, quality/kl (mean; quality/kl_stderr its standard error, tokens
clustered by sequence), quality/kl_p99, quality/top1_agree,
quality/tokens; quality.md and per_sequence.csv (per held-out sequence: tokens, sums of KL, NLL and agreement, which
pair runs over the same set sequence by sequence) beside the record.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from mla_quant.calibration.data import resolve_source, text_ids, toy_ids
from mla_quant.cache.bytes import HeldBytes
from mla_quant.models.absorbed import cache_kwargs, new_cache
from mla_quant.models.families import text_config
from mla_quant.prepare import check_context, model_dims, preflight, prepare_model
from mla_quant.record import write_text_atomic
from mla_quant.stages import StageResult
from mla_quant.stats import clustered_stderr


def held_out_ids(data: DictConfig, source: str, tokenizer, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, T), scored (N, T) bool): which tokens count. The toy was trained to predict answers only (its
    prompts hold random keys, numbers and filler), so on its documents only the answer tokens are scored."""
    n, t, seed = int(data.samples), int(data.seq_len), int(data.seed)
    if n < 1 or t < 2:
        raise ValueError(f"task.data.samples={n}, task.data.seq_len={t}: need at least 1 sequence of 2 tokens")
    if source == "toy":
        return toy_ids(tokenizer, n, t, seed, split=data.split, scored=True)
    if source == "text":
        ids = text_ids(data, tokenizer, n, t, purpose="quality", key="task.data")
    elif source == "random":
        ids = torch.randint(3, vocab_size, (n, t), generator=torch.Generator().manual_seed(seed))
    else:
        raise ValueError(f"task.data.source={source!r}; allowed: auto, toy, text, random")
    return ids, torch.ones_like(ids, dtype=torch.bool)


@torch.no_grad()
def logits_over_cache(model, ids: torch.Tensor, factory, chunk: int | None, held: HeldBytes | None = None
                      ) -> torch.Tensor:
    """float32 logits of `ids` (B, T) run over one fresh cache, `chunk` tokens per forward (None: all at once);
    the bytes the filled cache used are added to `held`."""
    cache = new_cache(model, factory)
    step = ids.shape[1] if not chunk else int(chunk)
    out = [model(ids[:, s:s + step], use_cache=True, **cache_kwargs(cache)).logits.float()
           for s in range(0, ids.shape[1], step)]
    if held is not None:
        held.add(cache)
    return torch.cat(out, dim=1)


def token_stats(ref: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per predicted token: NLL under each, KL(ref || quant), top-1 agreement. Logits (B, T, V), targets (B, T)."""
    lr, lq = ref.log_softmax(-1), quant.log_softmax(-1)
    idx = targets.unsqueeze(-1)
    return {"nll_ref": -lr.gather(-1, idx).squeeze(-1), "nll": -lq.gather(-1, idx).squeeze(-1),
            "kl": (lr.exp() * (lr - lq)).sum(-1).clamp_min(0), "agree": (ref.argmax(-1) == quant.argmax(-1)).float()}


def per_sequence_sums(stats: dict[str, torch.Tensor]) -> pd.DataFrame:
    """One row per held-out sequence (its index in the deterministic held-out set): scored tokens and the sums of
    KL, NLL under each cache and top-1 agreement. Two runs over the same set pair up sequence by sequence (the
    analysis' paired KL table)."""
    seq = stats["sequence"].long()
    ids, inverse = torch.unique(seq, return_inverse=True)
    out = {"sequence": ids.tolist(),
           "tokens": torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(stats["kl"]))}
    for key in ("kl", "nll", "nll_ref", "agree"):
        out[f"{key}_sum"] = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, stats[key])
    return pd.DataFrame({k: (v.tolist() if torch.is_tensor(v) else v) for k, v in out.items()}).astype({"tokens": int})


def check_streamed(cfg: DictConfig) -> None:
    """What a streamed quality run refuses (model.streaming=true), before the data (whose vocabulary is the model's
    config's) or any weight is read."""
    from mla_quant.prepare import refuse_unstreamed

    t = cfg.task
    refuse_unstreamed(cfg)
    if t.get("chunk") is not None:
        raise ValueError(f"model.streaming=true: task.chunk={t.chunk} is not streamed (a later chunk's layer arguments "
                         "depend on the cache the earlier chunks filled); set task.chunk=null")


def check(cfg: DictConfig) -> str:
    """Everything this stage refuses, before any weight is read: its options, the held-out text (loaded, or refused
    naming task.data and the local-file alternative), the model's settings (`preflight`). -> the data source."""
    t = cfg.task
    if cfg.model.get("streaming"):
        check_streamed(cfg)
    chunk = t.get("chunk")
    if chunk is not None and int(chunk) < 1:
        raise ValueError(f"task.chunk={chunk}: give a positive number of tokens per forward, or null")
    source = resolve_source(t.data, cfg.model.get("_target_"))
    if t.data.get("data_files") and source != "text":
        raise ValueError(f"task.data.data_files is set but task.data.source resolves to {source!r}, which reads no "
                         f"files; set task.data.source=text or drop it")
    check_context("task.data.seq_len", t.data.seq_len, model_dims(cfg.model))
    if source == "text":  # the held-out text, loaded and cut into samples x seq_len tokens before the weights
        from mla_quant.models.build import load_tokenizer

        text_ids(t.data, load_tokenizer(cfg.model), int(t.data.samples), int(t.data.seq_len), "quality", "task.data")
    preflight(cfg, tokenizer=source in ("toy", "text"))
    return source


def _add_stats(parts: dict, ref, quant, x, keep, start: int) -> None:
    """One batch's per-token statistics (ref/quant logits (B, T, V) of ids x, scored positions keep) into `parts`."""
    for k, v in token_stats(ref, quant, x[:, 1:]).items():
        parts.setdefault(k, []).append(v[keep].cpu())
    rows = torch.arange(start, start + x.shape[0], device=keep.device)[:, None].expand_as(keep)
    parts.setdefault("sequence", []).append(rows[keep].cpu())


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    t = cfg.task
    torch.set_num_threads(int(t.threads))
    source = check(cfg)  # before any weight is read
    if cfg.model.get("streaming"):
        return streamed(cfg, run_dir, source)
    chunk = t.get("chunk")
    prep = prepare_model(cfg, tokenizer=source in ("toy", "text"))
    model = prep.model
    ids, scored = held_out_ids(t.data, source, prep.tokenizer, int(text_config(model.config).vocab_size))
    device = next(model.parameters()).device
    factory = prep.layer_factory()
    parts: dict[str, list[torch.Tensor]] = {}
    held = HeldBytes()  # what the quantized caches used, at the sequences' length
    batch = int(t.batch_size)
    for s in tqdm(range(0, len(ids), batch), desc="quality", unit="batch"):
        x = ids[s:s + batch].to(device)
        ref = logits_over_cache(model, x, None, chunk)[:, :-1]
        quant = logits_over_cache(model, x, factory, chunk, held)[:, :-1]
        _add_stats(parts, ref, quant, x, scored[s:s + batch, 1:].to(device), s)
    return _result(cfg, run_dir, source, parts, held, prep.metrics())


def _result(cfg: DictConfig, run_dir: Path, source: str, parts: dict, held: HeldBytes, prep_metrics: dict
            ) -> StageResult:
    stats = {k: torch.cat(v).double() for k, v in parts.items()}
    per_sequence = per_sequence_sums(stats)  # also the clusters of the KL's standard error
    write_text_atomic(run_dir / "per_sequence.csv", per_sequence.to_csv(index=False))
    ppl, ppl_ref = stats["nll"].mean().exp().item(), stats["nll_ref"].mean().exp().item()
    metrics = {**prep_metrics, "quality/source": source, "quality/tokens": int(stats["kl"].numel()),
               "quality/ppl": ppl, "quality/ppl_unquantized": ppl_ref, "quality/ppl_ratio": ppl / ppl_ref,
               "quality/kl": stats["kl"].mean().item(), "quality/kl_p99": stats["kl"].quantile(0.99).item(),
               "quality/kl_stderr": clustered_stderr(per_sequence["kl_sum"], per_sequence["tokens"]),
               "quality/top1_agree": stats["agree"].mean().item(), **held.metrics("cache")}
    df = pd.DataFrame([{"cache": cfg.quant.name, "transform": (cfg.get("transform") or {}).get("name", "none"),
                        "data": source, "tokens": metrics["quality/tokens"], "ppl": ppl, "ppl unquantized": ppl_ref,
                        "KL": metrics["quality/kl"], "KL SE": metrics["quality/kl_stderr"],
                        "KL p99": metrics["quality/kl_p99"],
                        "top-1 agree": metrics["quality/top1_agree"]}])
    text = df.to_markdown(index=False, floatfmt=".4g")
    write_text_atomic(run_dir / "quality.md", text + "\n")
    print(text)
    return StageResult(metrics=metrics)


@torch.no_grad()
def streamed(cfg: DictConfig, run_dir: Path, source: str) -> StageResult:
    """The quality stage with the model streamed layer by layer (model.streaming=true, mla_quant.models.streaming):
    both caches' hidden states go through each decoder layer while it is resident; the same metrics as in memory,
    plus the stream's figures (streaming/...)."""
    from mla_quant.cache import layer_factory
    from mla_quant.models.streaming import drop_cache_slots, head_logits, layer_arguments, run_layer
    from mla_quant.prepare import prepare_streamed
    from mla_quant.quant.formats import as_spec

    t = cfg.task
    stream, prep = prepare_streamed(cfg, tokenizer=source in ("toy", "text"))
    model, tokenizer, dims, fmt, device = stream.model, prep.tokenizer, prep.dims, prep.fmt, stream.device
    ids, scored = held_out_ids(t.data, source, tokenizer, int(text_config(model.config).vocab_size))
    factory = layer_factory(as_spec(fmt, int(dims["layers"]))) if fmt is not None else None
    store = stream.host_store(run_dir)
    batch = int(t.batch_size)
    starts = list(range(0, len(ids), batch))
    streams = {"ref": None, "quant": factory}
    arguments, carried, caches = {}, {}, {}
    try:
        stream.load_outer()
        for s in starts:
            x = ids[s:s + batch].to(device)
            for name, fac in streams.items():
                caches[name, s] = new_cache(model, fac)
                hidden, arguments[name, s] = layer_arguments(model, x, caches[name, s])
                store.put((name, s), hidden)
                carried[name, s] = {}
        stream.release_outer()
        for j, layer in tqdm(stream.layers(), total=stream.num_layers, desc="quality (streamed)", unit="layer"):
            for key in arguments:
                h, carried[key] = run_layer(layer, stream.family, store.pop(key).to(device), arguments[key][j],
                                            carried[key])
                store.put(key, h)
            for s in starts:  # the unquantized cache is not read again (the quantized one is measured at the end)
                drop_cache_slots(caches["ref", s], [attn.layer_idx for _, attn in stream.blocks(j)])
        stream.load_outer()
        parts: dict[str, list[torch.Tensor]] = {}
        held = HeldBytes()
        for s in starts:
            x = ids[s:s + batch].to(device)
            ref = head_logits(model, x, store.pop(("ref", s)))[:, :-1]
            quant = head_logits(model, x, store.pop(("quant", s)))[:, :-1]
            held.add(caches["quant", s])
            _add_stats(parts, ref, quant, x, scored[s:s + batch, 1:].to(device), s)
    finally:
        store.close()
        stream.close()
    figures = {**stream.figures(), "streaming/host_peak_hidden_gb": store.peak_bytes_in_memory / 1e9,
               "streaming/spilled_gb": store.bytes_spilled / 1e9}
    print(" ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in figures.items()), flush=True)
    return _result(cfg, run_dir, source, parts, held, {**prep.metrics(), **figures})
