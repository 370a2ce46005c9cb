"""Peer caches: transformers' own `QuantizedCache` layers (optimum-quanto and HQQ backends) holding the latent, as
quant options (`conf/quant/hf_*.yaml`), so every comparison can carry the cache a user would pick instead.

    fmt = peer_format(cfg.quant, d_c=512, d_r=64)        # a `quant` config with a `peer` block; validates first
    fmt.bytes_per_token()                                 # nominal bytes of one quantized token (fp16 scale + zero)

A peer option has two keys: `name` and `peer` {library, bits, group_size, residual_length}. What transformers does
with them is kept as it is (mla_quant/cache/peers.py runs its layer classes): the prefill step sees its tokens
unquantized and then stores them quantized; later tokens wait unquantized until `residual_length` of them gathered,
then the whole history (dequantized) and they are quantized again at once. The step that appends tokens sees them
fresh, as `quant.mode=serving` does for the project's formats. Groups are `group_size` consecutive channels of one
token (quanto's axis 0, HQQ's axis 1), each with a scale and a zero (quanto: shift) in the activation dtype.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from mla_quant.checks import int_setting

# library -> (transformers layer class, its axis for groups of consecutive channels, bits it takes, pip package)
LIBRARIES = {
    "quanto": ("QuantoQuantizedLayer", 0, (2, 4), "optimum-quanto", "optimum.quanto"),
    "hqq": ("HQQQuantizedLayer", 1, (1, 2, 3, 4, 8), "hqq", "hqq"),
}
PEER_KEYS = ("library", "bits", "group_size", "residual_length")
# library -> groups its bit-packing takes at once, per width (HQQ: a tensor of another number of groups fails, so the
# cache pads it with zero tokens); a library absent here packs any number of groups
PACK_ROWS = {"hqq": {1: 8, 2: 4, 3: 10, 4: 2, 8: 1}}


def is_peer(quant_cfg) -> bool:
    """True for a quant config (mapping or DictConfig) that names a peer cache (a `peer` block)."""
    return quant_cfg is not None and "peer" in quant_cfg


def refuse_peer(quant_cfg, what: str) -> None:
    """Where `what` needs one of the project's own formats (its codecs, byte formula, kernel or export), a peer
    option is refused by name before any work."""
    if is_peer(quant_cfg):
        raise ValueError(f"quant={quant_cfg.get('name', '?')} is transformers' own QuantizedCache (a peer option): "
                         f"{what} reads the project's cache formats; use one of them (e.g. int4_joint)")


@dataclass(frozen=True)
class PeerFormat:
    """A validated peer option for a model with latent dims (d_c, d_r). Duck-types the parts of `CacheFormat` that
    stages read (name, quantized, mode, backend, step_backends, kernel_unsupported); the rest is its own."""

    name: str
    library: str
    bits: int
    group_size: int
    residual_length: int
    d_c: int
    d_r: int

    quantized = True
    mode = "serving"  # the appending step sees its own tokens unquantized (transformers' update returns them)
    backend = "torch"  # attention runs in PyTorch over the dequantized history transformers returns

    @property
    def axis(self) -> int:
        return LIBRARIES[self.library][1]

    @property
    def pack_rows(self) -> int | None:
        """Groups the library's bit-packing takes at once at these bits (None: any number)."""
        rows = PACK_ROWS.get(self.library)
        return None if rows is None else rows[self.bits]

    def step_backends(self, device_type: str) -> dict[str, str]:
        return {"prefill": "torch", "decode": "torch"}

    def kernel_unsupported(self) -> str | None:
        return f"peer.library={self.library} (transformers' QuantizedCache; the Triton kernel reads the project's formats)"

    cpu_kernel_unsupported = kernel_unsupported

    def quantized_positions(self, length: int) -> tuple[int, int]:
        """transformers' quantized layer quantizes a prompt appended at once as a whole (its residual holds only later
        tokens): every position."""
        return 0, length

    def bytes_per_token(self, act_bytes: int = 2) -> float:
        """Nominal bytes of one quantized token of both paths: packed codes plus a scale and a zero per group in the
        activation dtype (`act_bytes`: 2 for BF16/FP16 checkpoints). The cache measures what it holds."""
        d = self.d_c + self.d_r
        return self.bits * d / 8 + 2 * act_bytes * d / self.group_size

    def describe(self) -> str:
        return (f"transformers QuantizedCache ({LIBRARIES[self.library][3]}) int{self.bits} g={self.group_size}, "
                f"the latest < {self.residual_length} tokens unquantized")


def peer_format(quant_cfg, d_c: int, d_r: int) -> PeerFormat:
    """Build and validate a peer option (keys `name` and `peer`) against the latent dims; needs the library."""
    from omegaconf import OmegaConf

    def plain(node) -> dict:
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)

    cfg = plain(quant_cfg)
    name = cfg.get("name", "?")
    extra = sorted(set(cfg) - {"name", "peer"})
    if extra:
        raise ValueError(f"quant={name}: {extra} do not apply to a peer option (quant.peer runs transformers' "
                         "QuantizedCache, whose appending step sees its own tokens unquantized, as quant.mode=serving; "
                         "its protected region is peer.residual_length); allowed keys: ['name', 'peer']")
    peer = plain(cfg["peer"])
    unknown = sorted(set(peer) - set(PEER_KEYS))
    if unknown:
        raise ValueError(f"quant.peer: unknown key(s) {unknown}; allowed: {sorted(PEER_KEYS)}")
    library = peer.get("library")
    if library not in LIBRARIES:
        raise ValueError(f"quant.peer.library={library!r} is unknown; allowed: {sorted(LIBRARIES)}")
    _, _, widths, package, module = LIBRARIES[library]
    bits = peer.get("bits")
    if bits not in widths:
        raise ValueError(f"quant.peer.bits={bits!r}: transformers' {library} cache takes bits {list(widths)}")
    group = peer.get("group_size")
    int_setting(group, "quant.peer.group_size", allowed=f"a positive integer dividing d_c={d_c} and d_r={d_r}")
    for path, d in (("d_c", d_c), ("d_r", d_r)):
        if d % group:
            both = [g for g in range(1, min(d_c, d_r) + 1) if d_c % g == 0 and d_r % g == 0]
            raise ValueError(f"quant.peer.group_size={group} does not divide {path}={d} (groups are consecutive "
                             f"channels of one token on each path); allowed: one of {both}")
    if d_r == 0 and library == "quanto":
        raise ValueError(f"quant={name}: the model has no RoPE key (qk_rope_head_dim 0) and transformers' quanto "
                         "cache cannot quantize a path of no dims (its groups must divide the path); allowed on this "
                         "model: the hqq peers (quant=hf_hqq_int2, hf_hqq_int4) or the framework's own formats")
    residual = peer.get("residual_length")
    int_setting(residual, "quant.peer.residual_length",
                allowed="an integer >= 1 (tokens held unquantized before transformers requantizes the history)")
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise ValueError(f"quant={name} runs transformers' {library} cache, which needs the {package} package: "
                         f"pip install -e \".[peers]\" (or pip install {package})")
    return PeerFormat(name, library, bits, group, residual, d_c, d_r)
