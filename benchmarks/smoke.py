"""One decode call per cache format at DeepSeek-V2-Lite's dims against the reference, on the GPU when there is one
(else the CPU interpreter): the first step of benchmarks/gpu_check.sh, so that a launch problem shows in seconds.

    PYTHONPATH=. python benchmarks/smoke.py            # SMOKE_TOKENS=1000 tokens per sequence
"""

import os

import torch
from omegaconf import OmegaConf

from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.factory import cache_layer_factory
from mla_quant.kernels.latent_decode import latent_decode
from mla_quant.kernels.torch_decode import latent_decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 576 ** -0.5

TOKENS = int(os.environ.get("SMOKE_TOKENS", "1000"))

for option in ("bf16", "int4_joint", "int2_content_int4_rope"):
    quant = OmegaConf.merge(load_quant_option(option), {"backend": "triton", "protected": {"n_sink": 4, "recent": 128}})
    layer = cache_layer_factory(quant, 512, 64)()
    layer.append(torch.randn(2, TOKENS, 512, device=DEVICE, dtype=torch.bfloat16),
                 torch.randn(2, TOKENS, 64, device=DEVICE, dtype=torch.bfloat16))
    segments = layer.segments()
    for heads in (16, 128):
        q = torch.randn(2, heads, 512, device=DEVICE, dtype=torch.bfloat16)
        qr = torch.randn(2, heads, 64, device=DEVICE, dtype=torch.bfloat16)
        ref = latent_decode_reference(q, qr, SCALE, segments)
        for dot in ("bf16", "ieee"):
            err = ((latent_decode(q, qr, SCALE, segments, dot=dot) - ref).abs().max() / ref.abs().max()).item()
            print(f"{option}, {heads} heads, dot={dot}: max relative error {err:.2e}")
            assert err < (2e-2 if dot == "bf16" else 1e-4), (option, heads, dot, err)
