"""The normalized Walsh-Hadamard rotation of k8v4's V half.

A fixed orthogonal rotation of the head dimension spreads a few outlier
channels over all of them before 4-bit rounding, so one large value no longer
sets the scale of its whole Q4_0 block. The normalized Sylvester matrix
H / sqrt(D) is symmetric and orthogonal, so it is its own inverse: the same
function rotates V on write and rotates the attention output back.

It is computed as butterflies (additions and subtractions, then one scale),
never as a matmul: elementwise float32 arithmetic gives every row the same
bits whatever the batch size and on CPU and CUDA alike, which a float32 matmul
does not (docs/ARCHITECTURE.md, Exactness).
"""

from __future__ import annotations

import torch


def check_power_of_two(head_dim: int) -> None:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Hadamard rotation needs head_dim a power of two, got head_dim={head_dim}"
        )


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ (H / sqrt(D)) along the last dimension, in float32; its own inverse."""
    d = x.shape[-1]
    check_power_of_two(d)
    lead = x.shape[:-1]
    y = x.to(torch.float32).reshape(-1, d)
    h = 1
    while h < d:
        # Pairs (i, i + h) inside each group of 2h: [a + b, a - b].
        g = y.reshape(-1, d // (2 * h), 2, h)
        a, b = g[:, :, 0, :], g[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return (y * (d ** -0.5)).reshape(*lead, d)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized Sylvester matrix H / sqrt(D) (for tests and analysis, not the hot path)."""
    check_power_of_two(d)
    m = torch.ones((1, 1), dtype=dtype)
    while m.shape[0] < d:
        m = torch.cat((torch.cat((m, m), 1), torch.cat((m, -m), 1)), 0)
    return m * (d ** -0.5)
