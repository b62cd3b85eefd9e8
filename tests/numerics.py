"""Float64 helpers the kernel tests share: random tensors, relative error, fresh leaves."""

import torch


def rand64(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)
