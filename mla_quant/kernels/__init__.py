"""Kernels over the latent cache: Triton decode attention and store (GPU), a fused C++ decode attention (CPU), each
with a same-signature PyTorch reference."""
