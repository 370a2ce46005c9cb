"""Triton kernels over the latent cache (decode attention), each with a same-signature PyTorch reference."""
