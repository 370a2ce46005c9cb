"""The cache format of the whole `quant` group (`CacheFormat`), one per cache layer (`CacheSpec`), and the bytes
a cache in a format holds per token."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mla_quant.kernels.backends import DECODE_BACKENDS, TORCH, decode_backend
from mla_quant.quant.path import PathFormat

MODES = ("simulated", "serving")
BACKENDS = ("auto", TORCH, *DECODE_BACKENDS)  # auto: decode steps through the Triton kernel on a CUDA device and
# through the fused C++ kernel on the CPU where the kernel reads the format (and, on the CPU, builds here), PyTorch
# otherwise; prefill and multi-token steps always in PyTorch
PATHS = ("content", "rope")  # the latent cache's two paths: the content latent c and the decoupled RoPE key k
STEP_TYPES = ("prefill", "decode")  # multi-token steps (prefill, scoring) / one query token per sequence
BASELINE = "bf16"  # the quant option of the unquantized cache (conf/quant/bf16.yaml), what tables compare against
TENSOR_SCALE_BYTES = 4  # one float32 per tensor-granularity path (or one shared by both paths), per sequence and layer


@dataclass(frozen=True)
class CacheFormat:
    """The whole `quant` group, validated against (d_c, d_r)."""

    name: str
    mode: str
    backend: str
    n_sink: int
    recent: int
    block_size: int
    content: PathFormat
    rope: PathFormat
    shared_scale: bool
    d_c: int
    d_r: int

    @property
    def quantized(self) -> bool:
        return self.content.quantized or self.rope.quantized

    def path(self, name: str) -> PathFormat:
        return {"content": self.content, "rope": self.rope}[name]

    def dim(self, name: str) -> int:
        return {"content": self.d_c, "rope": self.d_r}[name]

    @property
    def token_block(self) -> int | None:
        """Tokens per block of a path quantized over blocks of tokens (channel_block), else None: a sequence's
        tokens that left the recent window wait unquantized (both paths) until they fill a block."""
        blocks = {p.blocked for p in (self.content, self.rope)} - {None}
        return blocks.pop() if blocks else None

    def quantized_positions(self, length: int) -> tuple[int, int]:
        """[start, end) of the positions that a sequence of `length` tokens appended at once (a prompt) holds
        quantized: after its sinks, before its recent window and the pending tokens of a block not yet full; (0, 0)
        when nothing is quantized."""
        if not self.quantized:
            return 0, 0
        start = min(self.n_sink, length)
        end = max(start, length - self.recent)
        if self.token_block:
            end -= (end - start) % self.token_block
        return start, end

    def bytes_per_token(self, act_bytes: int = 2) -> float:
        """Bytes one token takes in the quantized region (both paths; unquantized ones at `act_bytes`)."""
        return self.content.bytes_per_token(self.d_c, act_bytes) + self.rope.bytes_per_token(self.d_r, act_bytes)

    def describe(self) -> dict[str, str]:
        return {"content": self.content.describe(),
                "rope": self.rope.describe() if self.d_r else "none (no RoPE key)"}

    def codebook_bytes(self) -> int:
        """Per layer constant bytes, shared by every sequence: the lloyd codebooks of both paths."""
        return self.content.codebook_bytes() + self.rope.codebook_bytes()

    def tensor_scale_bytes(self) -> int:
        """Per sequence and layer constant bytes: float32 per-tensor fp8 scales (one if shared)."""
        n = sum(p.tensor_scaled for p in (self.content, self.rope))
        return TENSOR_SCALE_BYTES * (min(n, 1) if self.shared_scale else n)

    def kernel_unsupported(self) -> str | None:
        """Why the Triton decode kernel cannot read this format (naming the setting), or None."""
        for path in PATHS:
            why = self.path(path).kernel_unsupported(self.dim(path))
            if why is not None:
                return f"quant.{path}.{why}"
        return None

    def cpu_kernel_unsupported(self) -> str | None:
        """Why the C++ CPU decode kernel cannot read this format (naming the setting), or None: what the Triton
        kernel cannot read, and a RoPE key of several widths (format=pairs)."""
        why = self.kernel_unsupported()
        if why is None and self.rope.whole_page:
            why = f"quant.rope.format={self.rope.format}"
        return why

    def step_backends(self, device_type: str) -> dict[str, str]:
        """Which backend runs each step type (STEP_TYPES) on a device of `device_type` ("cpu", "cuda"): prefill
        and multi-token steps always in PyTorch; decode steps through the Triton kernel with backend=triton, the C++
        kernel with backend=cpu, and with backend=auto the Triton kernel on a CUDA device and the C++ kernel on the
        CPU where the kernel reads the format (and the C++ one builds here): kernels/backends.py's registry."""
        return {"prefill": TORCH, "decode": decode_backend(self, device_type)}


TOP_KEYS = ("name", "mode", "backend", "protected", "content", "rope", "shared_scale", "block_size", "layers")
MIXED_KEYS = ("budget", "choices", "allocation")  # quant=mixed: allocated per layer by the preparation step
LAYER_KEYS = PATHS  # what one entry of quant.layers may change
COMMON = ("mode", "backend", "n_sink", "recent", "block_size")  # one value for every layer (dims may differ)


@dataclass(frozen=True)
class CacheSpec:
    """The resolved cache of a run: one entry per cache layer, each a validated `CacheFormat` at that layer's dims (or,
    for transformers' own QuantizedCache, its `PeerFormat`). A uniform option is its one entry repeated; `quant.layers`,
    a `quant=mixed` allocation and lloyd codebooks (levels fitted per layer) give each layer its own. The settings
    common to all layers (mode, backend, protected region, block size) are read from the spec; what differs per layer
    from `layer(i)`; a reader of one format for the whole model takes `uniform` (or `one(what)`, refused by name)."""

    name: str
    layers: tuple
    source: str = "quant.layers"  # where the per-layer formats came from (an allocation file for quant=mixed)

    def __post_init__(self):
        if not self.layers:
            raise ValueError(f"quant={self.name}: quant.layers is empty; allowed: one entry per cache layer")
        for key in COMMON:
            values = {getattr(f, key, None) for f in self.layers}
            if len(values) > 1:
                raise ValueError(f"quant={self.name}: {key} differs between layers ({sorted(values)}); it is "
                                 f"common to all layers")

    def __len__(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def uniform(self):
        """The one entry every layer has (a uniform option at one (d_c, d_r)), else None (worked out once: the spec is
        frozen)."""
        return self.layers[0] if len(set(self.layers)) == 1 else None

    def one(self, what: str):
        """The uniform entry; where `what` reads one cache format for the whole model and layers differ, refused by
        name."""
        if self.uniform is None:
            raise ValueError(f"quant={self.name} gives each cache layer its own format ({self.source}): {what} reads "
                             f"one format for the whole model; use a uniform option (e.g. int2_content_int4_rope)")
        return self.uniform

    @property
    def peer(self) -> bool:
        """transformers' own QuantizedCache (a peer option), not one of the project's formats."""
        return not isinstance(self.layers[0], CacheFormat)

    @property
    def identity_layers(self) -> tuple:
        """What identifies the spec's formats: the uniform entry alone, or every layer's."""
        return (self.uniform,) if self.uniform is not None else self.layers

    @property
    def one_format(self) -> bool:
        """Every layer stores the same paths, a layer without a RoPE key aside (it stores none): one option at each
        layer's own dims (a model whose layers' dims differ), not a format per layer."""
        if self.peer:
            return True
        ropes = {f.rope for f in self.layers if f.d_r > 0}
        return len({f.content for f in self.layers}) == 1 and len(ropes) <= 1 and len(
            {f.shared_scale for f in self.layers if f.d_r > 0}) <= 1

    def layer(self, idx: int):
        return self.layers[idx]

    def __getattr__(self, key):  # the settings common to all layers
        if key in COMMON:
            return getattr(self.layers[0], key)
        raise AttributeError(f"{type(self).__name__} has no {key!r}: it differs per layer (use .layer(i))")

    @property
    def quantized(self) -> bool:
        return any(f.quantized for f in self.layers)

    @property
    def token_block(self) -> int | None:
        blocks = {getattr(f, "token_block", None) for f in self.layers} - {None}
        return blocks.pop() if len(blocks) == 1 else None

    def quantized_positions(self, length: int) -> tuple[int, int]:
        """The positions quantized in every quantized layer (`CacheFormat.quantized_positions`)."""
        spans = [f.quantized_positions(length) for f in self.layers if f.quantized]
        if not spans:
            return 0, 0
        start = max(a for a, _ in spans)
        return start, max(start, min(b for _, b in spans))

    def kernel_unsupported(self) -> str | None:
        return self._first_refusal("kernel_unsupported")

    def cpu_kernel_unsupported(self) -> str | None:
        return self._first_refusal("cpu_kernel_unsupported")

    def _first_refusal(self, check: str) -> str | None:
        """The first layer's reason from its `check` method (naming the layer where layers differ), or None when
        every layer passes."""
        for i, f in enumerate(self.identity_layers):
            why = getattr(f, check)()
            if why is not None:
                return why if self.uniform is not None else f"layers[{i}]: {why}"
        return None

    def step_backends(self, device_type: str) -> dict[str, str]:
        per_layer = [f.step_backends(device_type) for f in self.identity_layers]
        return {step: "+".join(sorted({b[step] for b in per_layer})) for step in STEP_TYPES}

    def bytes_per_token(self, act_bytes: int = 2) -> list[float]:
        """Per layer: bytes one token takes in the quantized region (both paths; unquantized ones at `act_bytes`)."""
        return [f.bytes_per_token(act_bytes) for f in self.layers]

    def describe(self) -> list[dict[str, str]]:
        return [f.describe() if isinstance(f, CacheFormat) else {"content": f.describe(), "rope": f.describe()}
                for f in self.layers]


def as_spec(fmt, num_layers: int = 1) -> CacheSpec | None:
    """A validated format as a `CacheSpec` (a `CacheFormat` or `PeerFormat` repeated over `num_layers` layers); a
    spec, or None, as it is."""
    if fmt is None or isinstance(fmt, CacheSpec):
        return fmt
    return CacheSpec(fmt.name, (fmt,) * num_layers, "the option")


def layer_format(fmt, idx: int):
    """Cache layer `idx`'s format: its own in a `CacheSpec`, the format itself otherwise."""
    return fmt.layer(idx) if isinstance(fmt, CacheSpec) else fmt


def refuse_layered(fmt, what: str):
    """Where `what` reads one cache format for the whole model, a spec whose layers differ is refused by name; ->
    the one format."""
    return fmt.one(what) if isinstance(fmt, CacheSpec) else fmt


def cache_bytes_per_token(fmt: CacheFormat, d_c: int, d_r: int, context: int, batch: int = 1,
                          act_bytes: int = 2) -> float:
    """Formula: bytes per token per layer of a cache holding `context` tokens per sequence for `batch` sequences,
    protected region (n_sink + recent tokens, in the activation dtype), per-sequence tensor scales and the layer's
    codebooks (lloyd: shared by the batch) included. With a token block (channel_block), the tokens past the last
    whole block wait in the activation dtype too."""
    if context <= 0:
        raise ValueError(f"context={context}: need at least one token")
    if not fmt.quantized:
        return float((d_c + d_r) * act_bytes)
    protected = min(context, fmt.n_sink + fmt.recent)
    if fmt.token_block:
        protected += (context - protected) % fmt.token_block  # the pending tokens of a block not yet full
    per_quantized = fmt.content.bytes_per_token(d_c, act_bytes) + fmt.rope.bytes_per_token(d_r, act_bytes)
    per_sequence = protected * (d_c + d_r) * act_bytes + (context - protected) * per_quantized
    return (per_sequence + fmt.tensor_scale_bytes() + fmt.codebook_bytes() / batch) / context
