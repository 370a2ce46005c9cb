"""Where the expanded prefill's time goes on this device: one padded 8K prefill at DeepSeek-V2-Lite's dims (bf16),
each form timed after a warm-up, then the expanded form under torch.profiler (top operators)."""
import time

import torch

from mla_quant.kernels.attention import UNBLOCKED, AttentionBlocks, CausalMask, latent_attention

dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
T = 8192 if dev == "cuda" else 512
g = torch.Generator(device=dev).manual_seed(0)
b, h, d_c, d_r, d_nope, d_v = 1, 16, 512, 64, 128, 128


def rnd(*shape, std=1.0):
    return (torch.randn(*shape, generator=g, device=dev) * std).to(dt)


q, qr, c, r = rnd(b, h, T, d_nope), rnd(b, h, T, d_r), rnd(b, T, d_c), rnd(b, T, d_r)
w_uk, w_uv = rnd(h, d_nope, d_c, std=d_c ** -0.5), rnd(h, d_v, d_c, std=d_c ** -0.5)
keys = torch.ones(b, T, dtype=torch.bool, device=dev)
keys[0, 0] = False
forms = {"blocked": AttentionBlocks(256, 2048), "expanded": AttentionBlocks(256, 2048, expand_from=256)}
for mask_name, mask in (("padded", CausalMask(keys)), ("unpadded", None)):
    for name, blocks in forms.items():
        def call():
            return latent_attention(q, qr, c, r, 0.1, mask, blocks=blocks, w_uk=w_uk, w_uv=w_uv)
        call()
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if dev == "cuda":
            torch.cuda.synchronize()
        print(f"{mask_name} {name}: {time.perf_counter() - t0:.3f} s", flush=True)
acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
with torch.profiler.profile(activities=acts) as prof:
    latent_attention(q, qr, c, r, 0.1, CausalMask(keys), blocks=forms["expanded"], w_uk=w_uk, w_uv=w_uv)
    if dev == "cuda":
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total" if dev == "cuda" else "cpu_time_total", row_limit=12))
