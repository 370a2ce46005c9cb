"""Capture, for each MLA block, everything its calibration objectives need, on the unquantized model.

    for cap in capture_layers(model, ids):        # one sweep: every decoder layer runs once over all sequences
        fit(cap)                                  # captures arrive in block order; one block's tensors at a time
    cap = capture_layer(model, ids, layer=2)      # one block alone: a forward stopped right after its input

LayerCapture (float32, on the model's device; N sequences, T tokens, H heads):
    x_hat    (N, T, d_c)   x / rms(x): the latent before its norm weight (the content transform acts on this)
    gamma    (d_c,)        the latent norm's weight; the cached latent is c = sigma * gamma * x_hat
    q_latent (N, H, T, d_c) the absorbed query W_UK^T q_nope (score side of the content path)
    q_rope   (N, H, T, d_r) the query's RoPE part after RoPE;  k_rope (N, T, d_r) the cached RoPE key after RoPE
    w_uv     (H, d_v, d_c)  each head's value map (the attention output per head is W_UV o_latent)

`capture_layers` is the sequential sweep (as llm-compressor's sequential pipeline): the inputs of decoder layer 0 are
captured once, then each decoder layer runs over every batch of sequences, its MLA blocks' pieces are recorded on the
way, and its outputs, kept on the CPU (`offload`), are the next layer's inputs: L decoder-layer forwards in all,
instead of 1 + 2 + ... + L for one stopped forward per block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_quant.kernels.attention import causal_latent_attention
from mla_quant.models.absorbed import attention_modules, decoder_layers
from mla_quant.models.families import MLAFamily, family_for_config, text_config
from mla_quant.models.fp8 import linear
from mla_quant.quant.quantizers import all_finite


EVAL_CHUNK = 8  # sequences per evaluation of an objective on a whole capture (its workspace bound)


@dataclass
class LayerCapture:
    layer: int
    x_hat: torch.Tensor
    gamma: torch.Tensor
    latent_scale: float
    q_latent: torch.Tensor
    q_rope: torch.Tensor
    k_rope: torch.Tensor
    w_uv: torch.Tensor
    scale: float
    cached_layout: str  # pair layout of the cached (post-RoPE) key
    ref_out: torch.Tensor | None = None  # (N, H, T, d_v) unquantized attention output per head (see `reference`)
    qk_energy: torch.Tensor | None = None  # sum of the squared visible RoPE scores (positional_qk's denominator)
    ids: torch.Tensor | None = None  # (N, T) the token ids captured (end-to-end objectives rerun the model on them)
    model: Any = field(default=None, repr=False, compare=False)  # the model they came from
    q_pos: torch.Tensor | None = None  # (T_q,) positions of the captured queries (calib.query_tokens); None = all T
    sinks: torch.Tensor | None = None  # (H,) the block's attention sinks (Hunyuan V4), in every softmax of the fit
    chunks: dict = field(default_factory=dict, repr=False, compare=False)  # `chunk` sub-captures, kept with their
    # reference outputs: every evaluation of the fit reuses them instead of recomputing the reference

    @property
    def content(self) -> torch.Tensor:
        return self.latent_scale * self.gamma * self.x_hat

    def chunk(self, start: int, stop: int) -> "LayerCapture":
        """rows(start:stop), the same object on every call (its reference output computed once)."""
        if (start, stop) not in self.chunks:
            self.chunks[start, stop] = self.rows(slice(start, stop))
        return self.chunks[start, stop]

    def eval_chunks(self, size: int = EVAL_CHUNK) -> list["LayerCapture"]:
        """The capture as the evaluations read it: itself, or its `chunk`s of `size` sequences (the same objects,
        with their reference outputs, on every call)."""
        n = self.x_hat.shape[0]
        return [self] if n <= size else [self.chunk(i, min(n, i + size)) for i in range(0, n, size)]

    def rows(self, idx) -> "LayerCapture":
        """The same capture restricted to sequences `idx`."""
        return LayerCapture(self.layer, self.x_hat[idx], self.gamma, self.latent_scale, self.q_latent[idx],
                            self.q_rope[idx], self.k_rope[idx], self.w_uv, self.scale, self.cached_layout,
                            ref_out=None if self.ref_out is None else self.ref_out[idx],
                            ids=None if self.ids is None else self.ids[idx], model=self.model, q_pos=self.q_pos,
                            sinks=self.sinks)


class _Stop(Exception):
    pass


def check_finite(name: str, x: torch.Tensor, layer: int) -> None:
    if not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"calibration capture, layer {layer}: {name} holds {bad} NaN/inf value(s) of {x.numel()}; "
                         f"check the model's dtype (float16 overflow?) and the calibration data")


@torch.no_grad()
def capture_layer(model, ids: torch.Tensor, layer: int, batch_size: int = 8,
                  query_tokens: int | None = None) -> LayerCapture:
    family = family_for_config(model.config)
    modules = attention_modules(model)
    if not 0 <= layer < len(modules):
        raise ValueError(f"layer {layer} out of range: the model has {len(modules)} MLA blocks")
    attn = modules[layer]
    w = family.mla_weights(attn)
    parts = _parts()

    record = _recorder(family, w, parts, layer, query_tokens)

    def hook(module, args, kwargs):
        record(module, args, kwargs)
        raise _Stop

    with _computed_from_pieces(family, dict(enumerate(modules[:layer])), {}, query_tokens):
        _stopped_forwards(model, ids, batch_size, attn, hook)
    return _layer_capture(family, model, attn, w, layer, parts, ids)


def _stopped_forwards(model, ids: torch.Tensor, batch_size: int, module, hook) -> None:
    """The model over `ids` in batches, each forward stopped by `hook` (a pre-hook on `module` raising _Stop)."""
    device = next(model.parameters()).device
    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for start in range(0, ids.shape[0], batch_size):
            try:
                model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()


def capture_stopped(model, ids: torch.Tensor, batch_size: int = 8, offload: str = "cpu", start: int = 0,
                    query_tokens: int | None = None) -> Iterator[LayerCapture]:
    """`capture_layers`' captures from one forward stopped at each block instead (1 + 2 + ... + L decoder-layer
    forwards): the reference the sweep is checked and benchmarked against."""
    for i in range(start, len(attention_modules(model))):
        yield capture_layer(model, ids, i, batch_size, query_tokens)


def _move(obj, device):
    """Tensors inside obj (tuples, lists, dicts) moved to `device`; anything else as is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _same(a, b) -> bool:
    """Equal structure and equal tensors (so one copy of the batch-independent arguments is kept)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device))))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or (type(a) is type(b) and not hasattr(a, "__dict__") and a == b)


@torch.no_grad()
def capture_layers(model, ids: torch.Tensor, batch_size: int = 8, offload: str = "cpu", start: int = 0,
                   query_tokens: int | None = None, stream=None) -> Iterator[LayerCapture]:
    """Each MLA block's `LayerCapture`, in block order, from one sweep over the decoder layers (module docstring).
    The decoder-layer outputs between layers are kept on `offload` ("cpu", or the model's device). Blocks before
    `start` are run through (their outputs are the later blocks' inputs) but not captured. `query_tokens`: keep the
    per-head query tensors at that many positions per sequence (`query_positions`; None: all). `stream`: the model
    streamed layer by layer (mla_quant.models.streaming.StreamedModel, whose `model` is `model`): each decoder layer
    resident while it runs and its blocks' captures are fitted."""
    family = family_for_config(model.config)
    modules = attention_modules(model)
    layers = decoder_layers(model)
    layer_of = {id(m): j for j, layer in enumerate(layers) for m in layer.modules()}
    owner = [layer_of[id(attn)] for attn in modules]
    device = stream.device if stream is not None else next(model.parameters()).device
    keep = torch.device(offload) if offload != "device" else device

    # 1. The inputs of decoder layer 0, per batch: its hidden states and the batch-independent arguments; and those
    # arguments for the first decoder layer of every other layer type (a hybrid stack's masks differ by type).
    kinds = list(getattr(text_config(model.config), "layer_types", None) or ["all"] * len(layers))
    firsts = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}  # layer type -> its first decoder layer
    hidden: list[torch.Tensor] = []
    arguments: dict[int, list[dict]] = {j: [] for j in firsts.values()}

    def recorder(j: int, last: bool):
        def hook(module, args, kwargs):
            kwargs = dict(kwargs)  # the forward goes on with its own arguments where it is not the last
            h = kwargs.pop("hidden_states", args[0] if args else None)
            if j == 0:
                hidden.append(h.to(keep))
            kwargs, kept = _move(kwargs, keep), arguments[j]
            kept.append(kept[-1] if kept and _same(kept[-1], kwargs) else kwargs)
            if last:
                raise _Stop
        return hook

    if stream is not None:  # the layers' arguments from stand-ins (no layer is resident yet)
        from mla_quant.models.streaming import layer_arguments

        stream.load_outer()
        for b0 in range(0, ids.shape[0], batch_size):
            h, args = layer_arguments(model, ids[b0:b0 + batch_size].to(device), None)
            hidden.append(h.to(keep))
            for j in firsts.values():
                kwargs, kept = _move(args[j], keep), arguments[j]
                kept.append(kept[-1] if kept and _same(kept[-1], kwargs) else kwargs)
        stream.release_outer()
    else:
        last = max(firsts.values())
        handles = [layers[j].register_forward_pre_hook(recorder(j, j == last), with_kwargs=True)
                   for j in firsts.values() if j != last]
        try:
            _stopped_forwards(model, ids, batch_size, layers[last], recorder(last, True))
        finally:
            for handle in handles:
                handle.remove()

    # 2. Each decoder layer once over every batch, recording its MLA blocks on the way; what a layer hands the next
    # beside its hidden states (GLM-5's top-k) is passed on per batch.
    carried: list[dict] = [{} for _ in hidden]
    for j, layer in (stream.layers() if stream is not None else enumerate(layers)):
        mine = [i for i, o in enumerate(owner) if o == j and i >= start]
        parts = {i: _parts() for i in mine}
        weights = {i: family.mla_weights(modules[i]) for i in mine}
        blocks = {i: modules[i] for i, o in enumerate(owner) if o == j}
        with _computed_from_pieces(family, blocks, parts, query_tokens):
            for b, h in enumerate(hidden):
                out = layer(h.to(device), **_move({**arguments[firsts[kinds[j]]][b], **carried[b]}, device))
                carried[b] = _move(family.carried(out), keep)
                out = out[0] if isinstance(out, tuple) else out
                hidden[b] = out.to(keep)
        for i in mine:
            yield _layer_capture(family, model, modules[i], weights[i], i, parts.pop(i), ids)


def _parts() -> dict[str, list[torch.Tensor]]:
    return {"x_hat": [], "q_latent": [], "q_rope": [], "k_rope": [], "ref_out": []}


def _keep(parts: dict, pieces, layer: int, q_pos) -> None:
    parts["q_pos"] = q_pos
    for name, value in zip(("x_hat", "q_latent", "q_rope", "k_rope"), pieces):
        check_finite(name, value, layer)
        parts[name].append(value)


def _recorder(family, w, parts: dict, layer: int, query_tokens: int | None = None):
    """A forward pre-hook recording the block's pieces (the stopped forwards)."""
    def hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        q_pos = query_positions(h.shape[1], query_tokens)
        _keep(parts, block_pieces(family, module, w, h, pe, q_pos, kwargs.get("position_ids")), layer, q_pos)

    return hook


def _recording_forward(family, module, w, parts: dict | None, layer: int, query_tokens: int | None):
    """The block's forward in a capture: its pieces recorded into `parts` (None: not kept), then its output computed
    from them (the attention over the latent, W_UV per head, o_proj), so the attention runs once for the next layer's
    inputs and for the objectives' reference output (`LayerCapture.ref_out`) alike, and the projections are not
    computed twice. The module's own forward runs instead (after the recording) where those pieces are not its whole
    input or output or would not bound memory: a mask (padding, or a family that narrows it, as V3.2's indexer), an
    output gate (AXK2, Hunyuan V4), attention sinks (Hunyuan V4), a cache,
    sampled query positions (`query_tokens`: no (B, H, T, d_c) query tensor is formed then, not even for a block not
    kept), a model that does not compute in float32 (its own rounding is kept), or weights an accelerate hook brings
    in (device_map offloading)."""
    own = module.forward
    plain = (type(family).attention_mask is MLAFamily.attention_mask and not family.output_gate
             and family.sinks(module) is None and not hasattr(module, "_hf_hook"))

    def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        q_pos = query_positions(hidden_states.shape[1], query_tokens)
        cached = kwargs.get("past_key_values", kwargs.get("cache"))
        fused = (plain and attention_mask is None and cached is None and q_pos is None
                 and hidden_states.dtype == torch.float32)
        if parts is not None or fused:
            pieces = block_pieces(family, module, w, hidden_states, position_embeddings, q_pos,
                                  kwargs.get("position_ids"))
            if parts is not None:
                _keep(parts, pieces, layer, q_pos)
        if not fused:
            return own(hidden_states=hidden_states, position_embeddings=position_embeddings,
                       attention_mask=attention_mask, **kwargs)
        x_hat, q_latent, q_rope, k_rope = pieces
        content = w.latent_scale * w.kv_norm.float() * x_hat
        heads = head_outputs(causal_latent_attention(q_latent, q_rope, content, k_rope, float(module.scaling)),
                             w.w_uv().float())  # (B, H, T, d_v)
        if parts is not None:
            parts["ref_out"].append(heads)
        b, t = hidden_states.shape[:2]
        return linear(module.o_proj, heads.transpose(1, 2).reshape(b, t, -1)), None

    return forward


@contextlib.contextmanager
def _computed_from_pieces(family, modules: dict, parts: dict, query_tokens: int | None):
    """Blocks {index: module} run `_recording_forward` inside the context, recording into parts[index] (absent:
    not kept); every capture computes the blocks before the captured one this way, so the sweep and the stopped
    forwards see the same numbers. A forward set on the instance before (an accelerate hook's) is put back after."""
    before = {i: m.__dict__.get("forward") for i, m in modules.items()}
    for i, m in modules.items():
        m.forward = _recording_forward(family, m, family.mla_weights(m), parts.get(i), i, query_tokens)
    try:
        yield
    finally:
        for i, m in modules.items():
            if before[i] is None:
                del m.forward  # the class's forward again
            else:
                m.forward = before[i]


def head_outputs(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Each head's attention output W_UV o_latent: (N, H, T, d_c), (H, d_v, d_c) -> (N, H, T, d_v)."""
    return torch.einsum("nhtc,hvc->nhtv", o_latent, w_uv)


def _layer_capture(family, model, attn, w, layer: int, parts: dict, ids: torch.Tensor) -> LayerCapture:
    gamma = w.kv_norm.detach().float()
    check_finite("the latent norm weight", gamma, layer)
    q_pos = parts.get("q_pos")
    ref = parts.get("ref_out") or []
    return LayerCapture(layer=layer, x_hat=torch.cat(parts["x_hat"]), gamma=gamma, latent_scale=w.latent_scale,
                        q_latent=torch.cat(parts["q_latent"]), q_rope=torch.cat(parts["q_rope"]),
                        k_rope=torch.cat(parts["k_rope"]), w_uv=w.w_uv().detach().float(), scale=float(attn.scaling),
                        cached_layout=family.cached_rope_layout(model.config), ids=ids.cpu(), model=model,
                        q_pos=None if q_pos is None else q_pos.to(parts["x_hat"][0].device),
                        ref_out=torch.cat(ref) if ref and len(ref) == len(parts["x_hat"]) else None,
                        sinks=None if family.sinks(attn) is None else family.sinks(attn).detach().float())


def query_positions(t: int, query_tokens: int | None) -> torch.Tensor | None:
    """The query positions kept of a T-token sequence: `query_tokens` evenly spaced ones ending at the last token
    (every distance to the start is represented), or None for all."""
    if query_tokens is None or query_tokens >= t:
        return None
    return torch.linspace(t - 1, 0, query_tokens).round().long().flip(0).unique()


def block_pieces(family, module, w, h: torch.Tensor, pe, q_pos: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None):
    """One MLA block's x_hat (x / rms(x)), absorbed query, RoPE query and RoPE key (after RoPE, the query with the
    family's position factor), float32; the queries at positions `q_pos` only (None: all), sampled before the
    absorption so no full (B, H, T, d_c) exists."""
    q_nope, q_rope, *_ = family.query(module, h)
    compressed = linear(module.kv_a_proj_with_mqa, h)
    x, k_rope = torch.split(compressed, [w.d_c, w.d_r], dim=-1)
    k_rope = family.key_norm(module, k_rope)
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + w.norm_eps)
    q_rope, k_rope = family.rotate(module, q_rope, k_rope, pe)
    factor = family.query_scale(module, position_ids)
    if factor is not None:
        q_nope, q_rope = q_nope * factor.to(q_nope.dtype), q_rope * factor.to(q_rope.dtype)
    if q_pos is not None:
        q_pos = q_pos.to(q_nope.device)
        q_nope, q_rope = q_nope[:, :, q_pos], q_rope[:, :, q_pos]
    return x_hat, q_nope.float() @ w.w_uk().float(), q_rope.float(), k_rope.float()


CAPTURES = {"sweep": capture_layers, "stopped": capture_stopped}  # fit_all(capture=...)
