"""lm-eval over the absorbed MLA model with a fresh latent cache per call, and the no-RoPE positional control.

`LatentCacheHFLM` is lm-eval's HFLM with two changes: every forward (`_model_call`) and generate
(`_model_generate`) runs over `new_cache(model, layer_factory)`, so a quantized cache format plugs in through
`layer_factory` (`mla_quant.models.absorbed.model_layer_factory`); and a context longer than the model's positions
raises `ContextTooLong` naming the limit instead of HFLM's silent left truncation.

    lm = LatentCacheHFLM(model, tokenizer, layer_factory=model_layer_factory(model, cfg.quant), batch_size=16)
    results = evaluate_tasks(lm, ["toy_gsm8k"], include_path=folder, limit=None)
    with rope_zeroed(model): ...            # every RoPE angle 0: positions are invisible to attention
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch

from mla_quant.cache.bytes import HeldBytes
from mla_quant.models.absorbed import cache_kwargs, new_cache
from mla_quant.models.families import text_config

log = logging.getLogger(__name__)


class ContextTooLong(ValueError):
    pass


def trailing_padding_mask(inps: torch.Tensor, pad_id: int = 0) -> torch.Tensor | None:
    """(B, T) attention mask that marks each row's trailing run of `pad_id` as padding: lm-eval right-pads the
    batches it scores with zeros and passes no mask. The rule is per row (a row scored alone gets the same mask),
    so a row's stored tokens, and so its protected region, do not depend on the batch. None when no row is padded."""
    real = (inps != pad_id).long()
    keep = real.flip(1).cummax(1).values.flip(1)  # 1 up to each row's last non-pad token
    keep[:, 0] = 1  # an all-pad row still scores its first position
    return None if bool(keep.all()) else keep


def _make_hflm_class():
    from lm_eval.models.huggingface import HFLM

    class LatentCacheHFLM(HFLM):
        """HFLM whose every model call runs over a fresh latent cache (see the module docstring)."""

        def __init__(self, model, tokenizer, layer_factory=None, **kwargs):
            logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)  # warns that we pass a model
            self.max_positions = int(text_config(model.config).max_position_embeddings)
            kwargs.setdefault("max_length", self.max_positions)
            super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
            self.layer_factory = layer_factory  # None = plain LatentCacheLayer
            self.cache_calls = 0
            self.held = HeldBytes()  # what every cache held after its call, summed

        def fresh_cache(self):
            self.cache_calls += 1
            return new_cache(self.model, self.layer_factory)

        def _check_length(self, n: int, what: str) -> None:
            if n > self.max_positions:
                raise ContextTooLong(f"{what} of {n} tokens exceeds the model's limit of {self.max_positions} "
                                     f"positions (config.max_position_embeddings); shorten the task's contexts")

        def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
            ids, mask = super().tok_batch_encode(strings, padding_side=padding_side, left_truncate_len=None,
                                                 truncation=truncation)
            if left_truncate_len and ids.shape[1] > left_truncate_len:
                raise ContextTooLong(
                    f"a context of {ids.shape[1]} tokens plus {self.max_positions - left_truncate_len} tokens to "
                    f"generate exceeds the model's limit of {self.max_positions} positions")
            return ids, mask

        def _model_call(self, inps, attn_mask=None, labels=None):
            self._check_length(inps.shape[1], "an input")
            mask = trailing_padding_mask(inps)
            cache = self.fresh_cache()
            with torch.no_grad():
                logits = self.model(inps, attention_mask=mask, use_cache=True, **cache_kwargs(cache)).logits
            self.held.add(cache)
            return logits

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            self._check_length(max_length, "a context plus generated tokens")
            cache = self.fresh_cache()
            generation_kwargs.update(cache_kwargs(cache))
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
            self.held.add(cache)
            return out

    return LatentCacheHFLM


def LatentCacheHFLM(model, tokenizer, **kwargs):  # noqa: N802 - a class, built lazily (lm_eval imports are slow)
    return _make_hflm_class()(model, tokenizer, **kwargs)


@contextlib.contextmanager
def rope_zeroed(model):
    """Set every RoPE angle to zero (inv_freq = 0) for the duration: each position rotates by 0, so attention
    cannot tell positions apart. Restores the frequencies afterwards."""
    rotary = model.model.rotary_emb
    saved = rotary.inv_freq.clone()
    rotary.inv_freq.zero_()
    try:
        yield model
    finally:
        rotary.inv_freq.copy_(saved)


def evaluate_tasks(lm, tasks: list, include_path: str | Path | list | None, *, limit=None, metadata=None,
                   include_defaults: bool = False, allow_code_execution: bool = False, gen_kwargs=None,
                   num_fewshot: int | None = None, seed: int = 0, bootstrap_iters: int = 1000,
                   log_samples: bool = False) -> dict:
    """lm_eval.simple_evaluate over `tasks`: names found in `include_path` (stock tasks only with include_defaults),
    or lm-eval Task objects already loaded (include_path None; mla_quant.eval.suites.load_stock_tasks).
    Standard errors: lm-eval's closed form for mean metrics (exact match), `bootstrap_iters` resamples otherwise.
    log_samples=True: lm-eval's per-example results under "samples" (`compact_samples` keeps what analysis reads)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines would bury the results
    if include_path is None:
        from mla_quant.eval.suites import registry

        tm = registry()
    else:
        paths = include_path if isinstance(include_path, list) else [include_path]
        tm = TaskManager(include_path=[str(p) for p in paths], include_defaults=include_defaults,
                         metadata=metadata or None)
    with environment_described_once():
        return simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit,
                               bootstrap_iters=bootstrap_iters, num_fewshot=num_fewshot, log_samples=log_samples,
                               confirm_run_unsafe_code=allow_code_execution,
                               gen_kwargs=gen_kwargs or None, random_seed=seed, numpy_random_seed=seed,
                               torch_random_seed=seed, fewshot_random_seed=seed, metadata=metadata or None)


@functools.cache
def _described(describe) -> str:
    return describe()


@contextlib.contextmanager
def environment_described_once():
    """lm-eval's simple_evaluate adds torch's description of the environment (`collect_env.get_pretty_env_info`:
    pip, conda, the GPU driver and CPU, queried in subprocesses, about 1 s) to every result. An evaluation calls it
    once per task, its unit of resumption; within it the description is taken once per process and reused (the
    environment of one process does not change), and the result still carries it."""
    from torch.utils import collect_env

    real = collect_env.get_pretty_env_info
    collect_env.get_pretty_env_info = functools.partial(_described, real)
    try:
        yield
    finally:
        collect_env.get_pretty_env_info = real


def compact_samples(samples: list[dict], needle_of=None) -> list[dict]:
    """lm-eval's logged samples of one task -> one row per example and filter: doc_id, filter, hashes of the
    document, prompt and target (the same example across runs), the target, the filtered response and the metric
    values (prompts and documents left out: RULER's are tens of thousands of tokens). needle_of: doc -> where the
    asked needle sits in the cache (`mla_quant.eval.needles.needle_region`), as "needle" where it is not None."""
    rows = []
    for s in samples:
        resp = s.get("filtered_resps") or [None]
        row = {"doc_id": s["doc_id"], "filter": s.get("filter"), "doc_hash": s.get("doc_hash"),
               "prompt_hash": s.get("prompt_hash"), "target": str(s.get("target")),
               "response": resp[0] if len(resp) == 1 else resp,
               "metrics": {m: s[m] for m in s.get("metrics", []) if m in s}}
        region = None if needle_of is None else needle_of(s.get("doc") or {})
        if region is not None:
            row["needle"] = region
        rows.append(row)
    return rows
