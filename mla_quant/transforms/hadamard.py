"""Random orthogonal matrices for the content path: randomized Hadamard (QuaRot's rotation) of any size.

    H = random_hadamard(512, generator)      # Sylvester Hadamard / sqrt(n), rows with random signs
    H = random_hadamard(96, generator)       # 96 = 3 * 32: kron(random orthogonal 3x3, Hadamard 32)

A Hadamard matrix spreads every channel's energy evenly over all channels, which evens out outlier channels before
per-group quantization. For sizes that are not a power of two the power-of-two factor gets the Hadamard and the
odd factor a random orthogonal matrix (Haar, by QR), so every output still mixes every input. Built on the host
(the generators are the CPU's); callers move them to the model's device.
"""

from __future__ import annotations

import torch


def random_orthogonal(n: int, generator: torch.Generator | None = None, dtype=torch.float64) -> torch.Tensor:
    """A Haar-random orthogonal n x n matrix (QR of a Gaussian matrix, signs fixed by R's diagonal)."""
    a = torch.randn(n, n, generator=generator, dtype=torch.float64, device="cpu")
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(n, dtype=q.dtype, device="cpu"))).to(dtype)


def sylvester_hadamard(n: int, dtype=torch.float64) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n) (orthogonal); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=dtype, device="cpu")
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def random_hadamard(n: int, generator: torch.Generator | None = None, dtype=torch.float64) -> torch.Tensor:
    """An orthogonal n x n matrix: Hadamard on the power-of-two factor of n (random orthogonal on the rest), with a
    random sign per input channel (QuaRot's randomized Hadamard)."""
    if n < 1:
        raise ValueError(f"rotation size {n} must be positive")
    pow2 = n & -n  # largest power of two dividing n
    odd = n // pow2
    h = sylvester_hadamard(pow2)
    if odd > 1:
        h = torch.kron(random_orthogonal(odd, generator).contiguous(), h.contiguous())
    signs = torch.randint(0, 2, (n,), generator=generator, device="cpu").double() * 2 - 1
    return (h * signs[None, :]).to(dtype)
