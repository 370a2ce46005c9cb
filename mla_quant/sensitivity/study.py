"""Measuring how a cache error in one path reaches the output, and the analytical predictor (docs/method.md section 2).

    probe = probe_ids(task.probe, model)
    clean = capture(model, probe, new_cache(model, RecordingLatentLayer))      # reference outputs + query energies
    noisy = capture(model, probe, new_cache(model, injection_factory(spec)))
    output_errors(noisy, clean)   # {"logits": nmse, "kl": ..., "attn_output": [per MLA layer], "layer_output": [...]}

Output NMSE is ||y_noisy - y||^2 / ||y||^2 over all tokens of the probe at: each MLA module's output (after o_proj),
each decoder layer's output, and the final logits; next-token KL is KL(p_clean || p_noisy) averaged over positions.
The predictor: for independent errors, E[(q . delta)^2] = sum_i E[q_i^2] E[delta_i^2], with q the scaled absorbed
query (q~ = tau W_UK^T q_nope) for the content path and the scaled RoPE query for the RoPE key; the ratio of the two
score-error energies predicts the RoPE/content amplification at the score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from mla_quant.models.absorbed import cache_kwargs, decoder_layers
from mla_quant.cache import LatentCacheLayer
from mla_quant.models.families import text_config
from mla_quant.sensitivity.injection import nmse


class RecordingLatentLayer(LatentCacheLayer):
    """A plain latent layer that also keeps, per coordinate, the mean energy of the scaled queries it served."""

    def __init__(self):
        super().__init__()
        self.q_latent_energy: torch.Tensor | None = None  # (d_c,)
        self.q_rope_energy: torch.Tensor | None = None  # (d_r,)

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, **absorbed):
        w_uk = absorbed.get("w_uk")
        # Summed one query token at a time block by block, so the (B, H, T, d_c) absorbed query never exists at once.
        energy, count = 0.0, 0
        for t0 in range(0, q_latent.shape[2], 64):
            q = q_latent[:, :, t0:t0 + 64]
            q = q if w_uk is None else q @ w_uk
            energy = energy + (q.double() * scale).pow(2).reshape(-1, q.shape[-1]).sum(0)
            count += q[..., 0].numel()
        self.q_latent_energy = (energy / count).cpu()
        self.q_rope_energy = (q_rope.double() * scale).pow(2).flatten(0, -2).mean(0).cpu()  # (d_r,), d_r may be 0
        return super().attend(q_latent, q_rope, content, rope, scale, mask, valid, **absorbed)


@dataclass
class Capture:
    logits: torch.Tensor  # (B, T, V)
    attn_output: list[torch.Tensor]  # per MLA module (cache layer): (B, T, hidden)
    layer_output: list[torch.Tensor]  # per decoder layer: (B, T, hidden)
    layer_of_attention: list[int]  # decoder layer holding each MLA module
    cache: object


@torch.no_grad()
def capture(model, ids: torch.Tensor, cache) -> Capture:
    """One forward over `ids` with `cache`, keeping every MLA module's and decoder layer's output."""
    attention = model.mla_family.attention_modules(model)
    layers = decoder_layers(model)
    attn_out: list = [None] * len(attention)
    layer_out: list = [None] * len(layers)
    attention_ids = {id(a) for a in attention}
    owner = {id(m): i for i, layer in enumerate(layers) for m in layer.modules() if id(m) in attention_ids}

    def keep(store, idx):
        def hook(module, args, output):
            store[idx] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    handles = [a.register_forward_hook(keep(attn_out, i)) for i, a in enumerate(attention)]
    handles += [layer.register_forward_hook(keep(layer_out, i)) for i, layer in enumerate(layers)]
    try:
        logits = model(ids, use_cache=True, **cache_kwargs(cache)).logits
    finally:
        for h in handles:
            h.remove()
    return Capture(logits.detach(), attn_out, layer_out, [owner[id(a)] for a in attention], cache)


def next_token_kl(noisy_logits: torch.Tensor, clean_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p_clean || p_noisy), in nats."""
    log_p = torch.log_softmax(clean_logits.double(), dim=-1)
    log_q = torch.log_softmax(noisy_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def output_errors(noisy: Capture, clean: Capture) -> dict:
    return {
        "logits": nmse(noisy.logits, clean.logits),
        "kl": next_token_kl(noisy.logits, clean.logits),
        "attn_output": [nmse(n, c) for n, c in zip(noisy.attn_output, clean.attn_output)],
        "layer_output": [nmse(n, c) for n, c in zip(noisy.layer_output, clean.layer_output)],
    }


def predicted_score_error(query_energy: torch.Tensor, error_energy: torch.Tensor) -> float:
    """E[(q . delta)^2] = sum_i E[q_i^2] E[delta_i^2] for an error independent of the query."""
    return float((query_energy * error_energy).sum())


def probe_ids(probe: DictConfig, model, tokenizer=None) -> torch.Tensor:
    """The calibration/probe batch (B, T): random ids (tiny random models), held-out prompts of the project's own
    needle-retrieval task (`tasks`, for models with a tokenizer such as the toy model), or Hugging Face text."""
    g = torch.Generator().manual_seed(int(probe.seed))
    if probe.source == "tasks":
        if tokenizer is None:
            raise ValueError("task.probe.source=tasks needs a model with a tokenizer (e.g. model=toy_mla)")
        from mla_quant.tasks import niah

        def count(text: str) -> int:
            return len(tokenizer(text).input_ids)

        docs = niah.test_set(probe.get("task", "multikey_1"), [int(probe.seq_len)], int(probe.num_sequences),
                             int(probe.seed), count)
        rows = [tokenizer(d["prompt"] + d["answer"]).input_ids for d in docs]
        t = min(len(r) for r in rows)  # documents fill the length up to a block: cut all to the shortest
        return torch.tensor([r[:t] for r in rows])
    if probe.source == "random":
        vocab = text_config(model.config).vocab_size
        return torch.randint(3, vocab, (probe.num_sequences, probe.seq_len), generator=g)
    if probe.source == "hf":
        if not probe.get("dataset"):
            raise ValueError("task.probe.source=hf needs task.probe.dataset (a Hugging Face dataset name)")
        if tokenizer is None:
            raise ValueError("task.probe.source=hf needs a model with a tokenizer")
        from datasets import load_dataset

        data = load_dataset(probe.dataset, probe.get("config"), split=probe.get("split", "train"))
        text = "\n\n".join(data[probe.get("text_field", "text")][: 10 * probe.num_sequences])
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        need = probe.num_sequences * probe.seq_len
        if ids.numel() < need:
            raise ValueError(f"dataset {probe.dataset!r} gave {ids.numel()} tokens, the probe needs {need}")
        return ids[:need].view(probe.num_sequences, probe.seq_len)
    raise ValueError(f"task.probe.source={probe.source!r}; allowed: random, tasks, hf")


@torch.no_grad()
def streamed_errors(stream, ids: torch.Tensor, clean_cache, noisy_caches: list, scratch=None,
                    desc: str = "sensitivity (streamed)") -> tuple[Capture, list[dict]]:
    """`capture` of the clean stream and `output_errors` of every noisy stream against it, with the model streamed
    layer by layer (mla_quant.models.streaming): each decoder layer, while resident, runs the clean stream and then
    every noisy one, whose attention and layer outputs are compared with the clean ones there and then; the logits
    at the end. -> (the clean Capture (logits, cache; no per-layer outputs kept), one errors dict per noisy stream)."""
    from tqdm.auto import tqdm

    from mla_quant.models.streaming import drop_cache_slots, head_logits, layer_arguments, run_layer

    model, family, device = stream.model, stream.family, stream.device
    attention = family.attention_modules(model)
    layers = decoder_layers(model)
    attention_ids = {id(a): i for i, a in enumerate(attention)}
    owner = [j for j in range(len(layers)) for _ in stream.blocks(j)]  # blocks come in cache-layer order
    caches = [clean_cache, *noisy_caches]
    ids = ids.to(device)
    store = stream.host_store(scratch)
    errors = [{"attn_output": [None] * len(attention), "layer_output": [None] * len(layers)} for _ in noisy_caches]
    outputs: dict[int, torch.Tensor] = {}

    def keep(module, args, output):
        outputs[attention_ids[id(module)]] = (output[0] if isinstance(output, tuple) else output).detach()

    handles = [a.register_forward_hook(keep) for a in attention]
    try:
        stream.load_outer()
        arguments = []
        for k, cache in enumerate(caches):
            hidden, args = layer_arguments(model, ids, cache)
            store.put(k, hidden)
            arguments.append(args)
        stream.release_outer()
        carried = [{} for _ in caches]
        for j, layer in tqdm(stream.layers(), total=stream.num_layers, desc=desc, unit="layer"):
            mine = [i for i, _ in stream.blocks(j)]
            clean_attn, clean_out = {}, None
            for k in range(len(caches)):
                outputs.clear()
                h, carried[k] = run_layer(layer, family, store.pop(k).to(device), arguments[k][j], carried[k])
                if k == 0:
                    clean_attn, clean_out = dict(outputs), h
                else:
                    for i in mine:
                        errors[k - 1]["attn_output"][i] = nmse(outputs[i], clean_attn[i])
                    errors[k - 1]["layer_output"][j] = nmse(h, clean_out)
                store.put(k, h)
            for cache in caches:  # nothing reads them after this layer (the recording layer's energies stay)
                drop_cache_slots(cache, [attention[i].layer_idx for i in mine])
        stream.load_outer()
        clean_logits = head_logits(model, ids, store.pop(0))
        for k in range(1, len(caches)):
            logits = head_logits(model, ids, store.pop(k))
            errors[k - 1]["logits"] = nmse(logits, clean_logits)
            errors[k - 1]["kl"] = next_token_kl(logits, clean_logits)
    finally:
        for h in handles:
            h.remove()
        store.close()
    return Capture(clean_logits, [], [], owner, clean_cache), errors
