"""A memory plan before any weight is read: what a stage will hold at its peak, from the config and the checkpoint's
config.json alone, against what the device has; a run that cannot fit is refused with the numbers and the settings
that would make it fit.

    plan = memory_plan(cfg, config, fmt)   # cfg.task.name's plan: rows of (component, bytes, how counted)
    print(plan.table())                     # one table at the start of the run (plan/* in its record)
    plan.check()                            # MemoryError when the predicted peak exceeds what the device has

`mla_quant.prepare.preflight` makes it for every stage in PLANNED (memory_plan=check|report; off: none).

The parameters are counted on the meta device (the model built from its config, no storage); the cache takes the
configured format's bytes per token (quantized region, protected region, scales); a forward's activations follow
the model's shapes at the stage's batch and context: the residual stream, the absorbed attention's per-head
queries and outputs in the latent (d_c) or expanded form with its score blocks (`attention.*`), the MLP's (or the
routed experts') intermediate, the logits. Predicted peaks were checked against the measured
`peak_added_allocated_gb` of the CPU runs (docs/scale.md, "Memory plan").
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from mla_quant.models.families import family_for_config, mla_layer_count, mla_setting
from mla_quant.quant.formats import as_spec

GB = 1e9
RUNTIME_BYTES = 0.04 * GB  # a first forward's one-time allocations beyond its tensors (CPU, toy and V2-Lite dims)
RUNTIME_HOW = "one-time allocations of the first forward (thread pools, kernel workspaces; 0.02-0.04 GB measured)"
PLANNED = ("quality", "evaluate", "sensitivity", "calibrate")  # the stages with a plan (task.name)


@dataclass
class MemoryPlan:
    stage: str
    device: str
    rows: list[tuple[str, float, str]] = field(default_factory=list)  # (component, bytes, how it was counted)
    available: float | None = None  # bytes the device has for this run (None: unknown)
    hints: list[str] = field(default_factory=list)  # settings that lower the peak, most effective first
    measured: set[str] = field(default_factory=set)  # rows measured on this machine, not predicted from the config

    def add(self, name: str, nbytes: float, how: str) -> None:
        self.rows.append((name, float(nbytes), how))

    @property
    def peak(self) -> float:
        return sum(b for _, b, _ in self.rows)

    def table(self) -> str:
        lines = [f"memory plan ({self.stage}, {self.device}):", "| component | GB | counted as |", "|---|---|---|"]
        lines += [f"| {name} | {b / GB:.3f} | {how} |" for name, b, how in self.rows]
        have = "unknown" if self.available is None else f"{self.available / GB:.1f} GB available"
        lines.append(f"| **peak** | **{self.peak / GB:.3f}** | {have} |")
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """For the run record: plan/peak_gb and plan/<component>_gb of the rows predicted from the config (what the
        device has and the rows measured on it are in the table only: the machine's state, not the run's result; a
        resumed run's metrics equal an uninterrupted one's)."""
        rows = [(name, b) for name, b, _ in self.rows if name not in self.measured]
        return {"plan/peak_gb": sum(b for _, b in rows) / GB,
                **{f"plan/{name.replace(' ', '_')}_gb": b / GB for name, b in rows}}

    def check(self) -> None:
        """Refuse a run whose predicted peak exceeds what the device has, with the numbers and what would fit."""
        if self.available is None or self.peak <= self.available:
            return
        biggest = sorted(self.rows, key=lambda r: -r[1])[:3]
        raise MemoryError(
            f"{self.stage} needs about {self.peak / GB:.1f} GB on {self.device} at its peak and "
            f"{self.available / GB:.1f} GB are available "
            f"({', '.join(f'{n} {b / GB:.1f} GB' for n, b, _ in biggest)}). It would not fit; "
            f"before any weight is read: {'; '.join(self.hints) or 'a smaller batch or context'}. "
            f"(the plan: mla_quant/plan.py; memory_plan=report prints it without refusing)")


def available_bytes(device: str, spread: bool = False) -> float | None:
    """Free memory of a CUDA device (spread=True: of every visible GPU, as device_map=auto fills them), or the
    host's MemAvailable for the CPU (None where unknown)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        devices = range(torch.cuda.device_count()) if spread else [torch.device(device)]
        return float(sum(torch.cuda.mem_get_info(d)[0] for d in devices))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=16)
def _parameters(config_json: str, family: str) -> int:
    from transformers import AutoConfig  # noqa: F401 - the config classes register with it

    from mla_quant.models.families import get_family

    fam = get_family(family)
    config = fam.config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = fam.model_class(config)
    return sum(p.numel() for p in model.parameters())


def parameter_count(config) -> int:
    """The model's parameters, counted on the meta device from its config alone."""
    from mla_quant.models.families import family_for_config

    return _parameters(config.to_json_string(use_diff=False), family_for_config(config).name)


def _dtype_bytes(name: str | None) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, None: 4}.get(name, 4)


def _text(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def forward_bytes(text, batch: int, tokens: int, act: int, blocks, logits_float: bool = True, flash: bool = False
                  ) -> dict[str, float]:
    """A prefill forward of `batch` x `tokens` through one decoder layer at a time (what lives at its peak), and the
    logits: {component: bytes}. flash=True: the attention through a flash kernel (a tile of scores, not counted)."""
    bt = batch * tokens
    h, heads = text.hidden_size, mla_setting(text, "num_attention_heads")  # the largest layer's, where they differ
    d_c, d_r = mla_setting(text, "kv_lora_rank"), mla_setting(text, "qk_rope_head_dim")
    d_nope, d_v = mla_setting(text, "qk_nope_head_dim"), mla_setting(text, "v_head_dim")
    residual = bt * h * act * 3  # the residual stream, the normed input and the sublayer's output
    q = bt * heads * (d_nope + d_r) * act  # the per-head queries
    expanded = blocks.expand_from is not None and tokens >= blocks.expand_from
    # scores per head and sequence: query x key tokens per block (the bound AttentionBlocks keeps), T x T unblocked
    per_head = min(tokens * tokens, blocks.query * blocks.key) if blocks.blocked else tokens * tokens
    if expanded:  # per-head K and V up-projected from the latent
        attn = q + bt * heads * (d_nope + d_r + d_v) * act + bt * heads * d_v * act
        scores = batch * heads * per_head * 4 * 2
    else:  # q_nope absorbed into the latent one query block at a time (d_c per head), the output per head (d_v)
        q_block = tokens if not blocks.blocked else min(tokens, blocks.queries_per_block(tokens))
        attn = (q + bt * heads * d_v * act + bt * (d_c + d_r) * act * 2
                + batch * heads * q_block * d_c * act * 2)
        scores = batch * heads * per_head * 4 * 3  # scores, their exponent, the block's mask
    inter = max(int(getattr(text, "intermediate_size", 0) or 0),
                int(getattr(text, "moe_intermediate_size", 0) or 0) * int(getattr(text, "num_experts_per_tok", 1) or 1))
    mlp = bt * inter * act * 3  # gate, up and their product
    scores = 0 if flash else scores
    logits = bt * text.vocab_size * (act + (4 if logits_float else 0))
    return {"activations": residual + max(attn + scores, mlp), "logits": logits}


def cache_bytes(fmt, text, batch: int, tokens: int, act: int) -> float:
    """The latent cache of `batch` sequences of `tokens` over every layer, in `fmt` (None: unquantized)."""
    layers = mla_layer_count(text)
    layer_dims = family_for_config(text).layer_dims(text)  # a NoPE layer (Mistral Large 4) caches no RoPE key
    full = sum(c + r for c, r in layer_dims) * act / len(layer_dims)
    spec = as_spec(fmt)
    if spec is None or not spec.quantized:
        return batch * tokens * layers * full
    protected = 0 if spec.peer else min(tokens, spec.n_sink + spec.recent)
    per_layer = spec.bytes_per_token(act)  # a quantized token of each layer (a peer's nominal bytes)
    per_token = sum(per_layer) / len(per_layer)
    return batch * layers * (protected * full + (tokens - protected) * per_token)


BATCH_SETTING = {"quality": "task.batch_size", "evaluate": "eval.batch_size", "sensitivity": "task.probe.num_sequences",
                 "calibrate": "calib.batch_size"}


def stage_shape(cfg: DictConfig, stage: str) -> tuple[int, int]:
    """(batch, tokens per sequence) of a stage's largest forward, from its settings."""
    t = cfg.task
    if stage == "quality":
        return int(t.batch_size), int(t.data.seq_len)
    if stage == "evaluate":
        ev = cfg.eval
        lengths = [int(n) for n in (ev.get("ruler") or {}).get("lengths") or []]
        if ev.get("data") is not None:
            lengths += [int(n) for n in ev.data.niah_lengths]
        return int(ev.batch_size), max(lengths or [2048])  # GSM8K's 5-shot prompts: ~1K tokens
    if stage == "sensitivity":
        return int(t.probe.num_sequences), int(t.probe.seq_len)
    if stage == "calibrate":
        return int(cfg.calib.batch_size), int(cfg.calib.seq_len)
    raise ValueError(f"no memory plan for stage {stage!r}; planned: {list(PLANNED)}")


def _stage_rows(plan: MemoryPlan, cfg, stage: str, text, batch: int, tokens: int, act: int, fmt, blocks) -> None:
    """quality, evaluate, sensitivity: the cache, what the stage holds, and the larger of a layer's forward and the
    logits."""
    shape = f"{batch} x {tokens} tokens"
    quant = (cfg.get("quant") or {}).get("name") if fmt is not None else None
    plan.add("latent cache", cache_bytes(fmt, text, batch, tokens, act),
             f"{shape}, {mla_layer_count(text)} MLA layers, {quant or 'unquantized'}")
    v, bt = text.vocab_size, batch * tokens
    if stage == "quality":  # the unquantized pass's float logits are kept while the quantized pass runs
        plan.add("held", bt * v * 4, f"the unquantized pass's logits ({shape} x {v} vocab, float32)")
    elif stage == "sensitivity":  # the clean run's outputs per layer and logits, beside an injected run's
        plan.add("held", 2 * (2 * text.num_hidden_layers * bt * text.hidden_size * 4 + bt * v * 4),
                 "the clean run's attention and layer outputs per layer and its logits (float32), and the injected "
                 "run's as they are captured")
    fwd = forward_bytes(text, batch, tokens, act, blocks)
    layer, head = fwd["activations"], fwd["logits"]
    plan.add("forward workspace", max(layer, head),
             f"the larger of one layer's forward at {shape} ({layer / GB:.3f} GB, attention "
             f"{'expanded' if blocks.expand_from is not None else 'latent'} blocks) and the logits ({head / GB:.3f} GB,"
             f" {v} vocab, and in float32)")


def capture_bytes(text, sequences: int, tokens: int, queries: int) -> int:
    """One layer's calibration capture (float32): the latents and RoPE keys of every token, the per-head queries and
    reference outputs at `queries` positions per sequence."""
    d_c, d_r, d_v, heads = (mla_setting(text, k) for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                                                            "num_attention_heads"))
    return sequences * tokens * (d_c + d_r) * 4 + sequences * heads * queries * (d_c + d_r + d_v) * 4


def _calibrate_rows(plan: MemoryPlan, cfg, text, batch: int, tokens: int, act: int, blocks, fitted: bool,
                    eval_chunk: int | None, device: str) -> None:
    """calibrate sweeps the decoder layers once over every calibration sequence (no cache, no logits), holding the
    hidden states between layers and one layer's capture; its peak is the larger of making the next layer's
    capture (the previous one still held, one batch's forward) and fitting on it (a minibatch's copy and the
    default objectives' workspace: the content path's attention, the RoPE path's cumulative key products)."""
    n, heads, h = int(cfg.calib.samples), mla_setting(text, "num_attention_heads"), text.hidden_size
    d_r = mla_setting(text, "qk_rope_head_dim")
    q = min(tokens, int(cfg.calib.get("query_tokens") or tokens))
    hidden = (n + batch) * tokens * h * act
    capture = capture_bytes(text, n, tokens, q)
    plan.add("held", hidden + capture,
             f"the hidden states of {n} sequences x {tokens} tokens between layers and one batch's input "
             f"({hidden / GB:.3f} GB), one layer's capture: latents, {q} queries per sequence and their reference "
             f"outputs ({capture / GB:.3f} GB, float32)")
    # every query, causal, on the CPU: causal_latent_attention's flash form (the capture's, in float32, and the fit's)
    flash = device.startswith("cpu") and q == tokens
    making = capture + forward_bytes(text, batch, tokens, act, blocks, flash=flash and act == 4)["activations"]
    b = min(n, int(cfg.transform.fit.get("batch", n))) if fitted else min(n, eval_chunk or n)
    if flash:  # PyTorch's flash kernel holds a tile of scores; its queries, keys, values and outputs per head (the
        # shared latent made contiguous), with their gradients when fitted
        attention = b * heads * tokens * (mla_setting(text, "kv_lora_rank") + d_r) * 4 * (8 if fitted else 4)
        what = "queries, keys, values and outputs per head through the flash kernel"
    else:  # sampled queries under a mask: every score of a query over its keys
        attention = b * heads * q * tokens * 4 * (6 if fitted else 2)
        what = "scores over every key, reference and quantized, their softmax"
    what = f"{b} sequences per {'step' if fitted else 'evaluation'}: {what}{' and gradients' if fitted else ''}"
    products = b * tokens * d_r * d_r * 4 * (4 if fitted else 2)
    fitting = capture * b / n + max(attention, products)
    plan.add("workspace", max(making, fitting),
             f"the larger of making the next layer's capture (the previous one held, one batch of {batch}'s forward:"
             f" {making / GB:.3f} GB) and fitting ({what}, the RoPE path's cumulative key products, the minibatch's "
             f"copy: {fitting / GB:.3f} GB)")


def memory_plan(cfg: DictConfig, config, fmt=None, device: str = "cpu", fitted: bool = False,
                eval_chunk: int | None = None, host: dict[str, float] | None = None) -> MemoryPlan:
    """The plan of `cfg`'s stage (task.name) on `device`: `config` the model's transformers config (read without
    weights), `fmt` the validated cache format, `fitted` whether calibration fits a transform (its workspace) and
    `eval_chunk` the sequences per evaluation of its objectives (None: all at once),
    `host` {component: bytes} the stage holds already, measured (lm-eval's loaded tasks; counted on the CPU only)."""
    from mla_quant.models.absorbed import attention_blocks

    stage = cfg.task.name
    text = _text(config)
    model_dtype = cfg.model.get("dtype")
    act = _dtype_bytes(model_dtype)
    blocks = attention_blocks(cfg.get("attention"))
    batch, tokens = stage_shape(cfg, stage)
    spread = cfg.model.get("device_map") == "auto"
    plan = MemoryPlan(stage, device + (" (every GPU)" if spread and device.startswith("cuda") else ""),
                      available=available_bytes(device, spread))
    params = parameter_count(config)
    plan.add("weights", params * act, f"{params / 1e9:.3g}B parameters x {act} B ({model_dtype or 'float32'})")
    if stage == "calibrate":
        _calibrate_rows(plan, cfg, text, batch, tokens, act, blocks, fitted, eval_chunk, device)
    else:
        _stage_rows(plan, cfg, stage, text, batch, tokens, act, fmt, blocks)
    plan.add("runtime", RUNTIME_BYTES, RUNTIME_HOW)
    for name, nbytes in (host or {}).items():  # what the stage already holds on the host (measured)
        if not device.startswith("cuda"):
            plan.add(name, nbytes, "measured as it was loaded, before the weights (host memory)")
            plan.measured.add(name)
    per_sequence = (plan.peak - plan.rows[0][1]) / max(batch, 1)
    if plan.available is not None and per_sequence > 0:
        fits = int((plan.available - plan.rows[0][1]) // per_sequence)
        if 1 <= fits < batch:
            plan.hints.append(f"{BATCH_SETTING[stage]}={fits} fits")
    if blocks.expand_from is not None and stage != "calibrate":
        plan.hints.append("attention=blocked (the latent form's workspace does not grow with the heads' K/V)")
    if plan.available is not None and plan.rows[0][1] > plan.available:
        plan.hints.append("the weights alone do not fit: more GPUs (model.device_map=auto over them) or a smaller "
                          "model.dtype")
    plan.hints.append("a shorter context")
    return plan


MODES = ("check", "report", "off")


def mode_of(cfg: DictConfig) -> str | None:
    """`memory_plan` of a run whose stage has a plan (check | report), else None (off, or no plan)."""
    mode = cfg.get("memory_plan", "check")
    if mode not in MODES:
        raise ValueError(f"memory_plan={mode!r}; allowed: {list(MODES)} (check: predict each stage's peak memory "
                         f"before any weight is read and refuse a run that cannot fit; report: predict only)")
    return None if mode == "off" or cfg.task.name not in PLANNED else mode
