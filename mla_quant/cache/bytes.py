"""Exact bytes per token per layer of every quant option, used and held, measured from filled caches.

    python -m mla_quant.cache.bytes               # the table at real dims (d_c 512, d_r 64), 4K / 32K / 128K
    rows = byte_table(["int4_joint"], [4096])     # one row per (option, context)
    held = HeldBytes(); held.add(cache); held.metrics("cache")   # what filled caches used, by part
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from mla_quant.cache.factory import layer_factory
from mla_quant.quant.formats import cache_bytes_per_token, cache_format, refuse_layered
from mla_quant.quant.peers import refuse_peer

QUANT_DIR = Path(__file__).resolve().parents[1] / "conf" / "quant"  # package data: read from an installed package too
BYTE_TABLE_OPTIONS = ("bf16", "fp8_flat", "fp8_ds_mla", "int8_joint", "int4_content", "int4_joint",
                      "int2_content_int4_rope", "int2_joint", "kivi_int2", "kivi_int4")
# Content group sizes of the release options at real dims (the model YAMLs' quant_group_size for d_c = 512).
REAL_GROUPS = {"wide": 128, "narrow": 64}


def load_quant_option(name: str, conf_dir: Path | str | None = None, groups: dict | None = None):
    """conf/quant/<name>.yaml as a DictConfig, its `${model.quant_group_size.*}` resolved from `groups`."""
    from omegaconf import OmegaConf

    conf_dir = Path(conf_dir) if conf_dir is not None else QUANT_DIR
    path = conf_dir / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown quant option {name!r}; allowed: {sorted(p.stem for p in conf_dir.glob('*.yaml'))}")
    root = OmegaConf.create({"model": {"quant_group_size": dict(groups or REAL_GROUPS)}, "quant": OmegaConf.load(path)})
    return OmegaConf.create(OmegaConf.to_container(root.quant, resolve=True))


def measure_bytes(fmt, contexts: Iterable[int], batch: int = 1, chunk: int = 4096,
                  dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[int, tuple[int, int]]:
    """Fill one layer of format `fmt` with a synthetic latent in chunks; {context: (used bytes, held bytes)}.
    One random chunk is appended repeatedly: the bytes a format takes do not depend on the values."""
    refuse_layered(fmt, "measure_bytes (one cache layer of one format)")
    layer = layer_factory(fmt)()
    gen = torch.Generator().manual_seed(seed)
    block_c = torch.randn(batch, chunk, fmt.d_c, generator=gen).to(dtype)  # (B, chunk, d_c)
    block_r = torch.randn(batch, chunk, fmt.d_r, generator=gen).to(dtype)  # (B, chunk, d_r)
    filled, out = 0, {}
    for ctx in sorted(contexts):
        while filled < ctx:
            t = min(chunk, ctx - filled)
            layer.append(block_c[:, :t], block_r[:, :t])
            filled += t
        out[ctx] = (layer.nbytes(), layer.held_bytes())
    return out


class HeldBytes:
    """The bytes every cache of an evaluation used, measured from its tensors after each call (each sequence at its
    real length: prompt plus generated tokens), per token and layer and by part (`LatentCache.byte_parts`): as held
    in this run's dtype, and at BF16 (2 bytes per activation value: what a BF16 checkpoint's cache holds, the unit of
    every byte figure the tables compare). A DSA indexer's keys (unquantized) and a hybrid stack's linear-attention
    states are counted apart, the states per sequence
    (`LatentCache.state_bytes`: they do not grow with the tokens)."""

    def __init__(self):
        self.token_layers = 0
        self.parts: dict[str, dict[str, float]] = {"held": {}, "bf16": {}}
        self.state = 0  # bytes of the non-MLA layers' states, over the sequences that held them
        self.state_sequences = 0
        self.indexer = 0  # bytes of the DSA indexers' keys (unquantized), over every layer's real tokens

    def add(self, cache) -> None:
        self.token_layers += sum(layer.real_tokens() for layer in cache.latent_layers)
        for unit, act_bytes in (("held", None), ("bf16", 2)):
            for part, b in cache.byte_parts(act_bytes).items():
                self.parts[unit][part] = self.parts[unit].get(part, 0.0) + b
        self.indexer += cache.indexer_bytes()
        state = cache.state_bytes()
        if state:
            self.state += state
            self.state_sequences += cache.sequences()

    def _combined(self, other: "HeldBytes", sign: int) -> "HeldBytes":
        """self + sign * other, tally by tally."""
        out = HeldBytes()
        out.token_layers = self.token_layers + sign * other.token_layers
        out.parts = {unit: {k: parts.get(k, 0.0) + sign * other.parts[unit].get(k, 0.0)
                            for k in {**parts, **other.parts[unit]}} for unit, parts in self.parts.items()}
        out.state = self.state + sign * other.state
        out.state_sequences = self.state_sequences + sign * other.state_sequences
        out.indexer = self.indexer + sign * other.indexer
        return out

    def __sub__(self, earlier: "HeldBytes") -> "HeldBytes":
        return self._combined(earlier, -1)

    def __add__(self, other: "HeldBytes") -> "HeldBytes":
        return self._combined(other, 1)

    def copy(self) -> "HeldBytes":
        return self - HeldBytes()

    def tally(self) -> dict:
        """The tallies as plain numbers (a finished unit's result in the run's progress: JSON); `from_tally`."""
        return {"token_layers": self.token_layers, "parts": self.parts, "state": self.state,
                "state_sequences": self.state_sequences, "indexer": self.indexer}

    @classmethod
    def from_tally(cls, tally: dict) -> "HeldBytes":
        out = cls()
        out.token_layers, out.indexer = tally["token_layers"], tally["indexer"]
        out.state, out.state_sequences = tally["state"], tally["state_sequences"]
        out.parts = {unit: dict(parts) for unit, parts in tally["parts"].items()}
        return out

    def metrics(self, prefix: str) -> dict[str, float]:
        """{prefix/held_B_per_token_per_layer, prefix/bf16_B_per_token_per_layer, prefix/bf16/<part>: B per token
        and MLA layer, prefix/tokens: tokens per layer; with a DSA indexer prefix/indexer_B_per_token_per_layer: its
        keys, unquantized, apart from the latent; in a hybrid stack prefix/state_B_per_sequence: its other layers'
        states, as held}; {} before any call."""
        n = self.token_layers
        if not n:
            return {}
        out = {f"{prefix}/{unit}_B_per_token_per_layer": sum(parts.values()) / n for unit, parts in self.parts.items()}
        out.update({f"{prefix}/bf16/{part.replace(' ', '_')}": b / n for part, b in self.parts["bf16"].items()})
        out[f"{prefix}/token_layers"] = float(n)
        if self.indexer:
            out[f"{prefix}/indexer_B_per_token_per_layer"] = self.indexer / n
        if self.state_sequences:
            out[f"{prefix}/state_B_per_sequence"] = self.state / self.state_sequences
        return out


def byte_table(options: Sequence[str] = BYTE_TABLE_OPTIONS, contexts: Sequence[int] = (4096, 32768, 131072),
               d_c: int = 512, d_r: int = 64, batch: int = 1, chunk: int = 4096, block_size: int | None = None,
               conf_dir=None) -> list[dict]:
    """Bytes per token per layer for every quant option and context: used and held, measured from a filled cache,
    and the formula (protected region included), with % of BF16 ((d_c + d_r) * 2 bytes). One row per
    (option, context); the stored dtype is bfloat16, as on real checkpoints."""
    bf16 = (d_c + d_r) * 2
    rows = []
    for name in tqdm(options, desc="cache bytes", unit="option"):
        cfg = load_quant_option(name, conf_dir)
        refuse_peer(cfg, "the byte table (its formula per format)")
        if block_size is not None:
            cfg.block_size = block_size
        fmt = cache_format(cfg, d_c, d_r)
        measured = measure_bytes(fmt, contexts, batch, chunk)
        for ctx in contexts:
            used, held = (m / (batch * ctx) for m in measured[ctx])
            rows.append({
                "option": name, "content": fmt.content.describe(), "rope": fmt.rope.describe(),
                "protected": f"{fmt.n_sink}+{fmt.recent}" if fmt.quantized else "none", "block": fmt.block_size,
                "context": ctx, "used_B_per_token": used, "held_B_per_token": held,
                "formula_B_per_token": cache_bytes_per_token(fmt, d_c, d_r, ctx), "held_over_used": held / used,
                "pct_of_bf16": 100.0 * used / bf16,
            })
    return rows


def format_byte_table(rows: Sequence[dict]) -> str:
    """Markdown table of `byte_table` rows."""
    head = ("| option | content | rope | protected | context | used B/tok/layer | held | held/used | formula | "
            "% of BF16 |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['option']} | {r['content']} | {r['rope']} | {r['protected']} | {r['context']} | "
                     f"{r['used_B_per_token']:.3f} | {r['held_B_per_token']:.3f} | {r['held_over_used']:.4f} | "
                     f"{r['formula_B_per_token']:.3f} | {r['pct_of_bf16']:.2f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_byte_table(byte_table()))
