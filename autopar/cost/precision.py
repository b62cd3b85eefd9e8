"""Bytes per parameter that training holds, from the parameters' dtype (never an op's): the
one rule the planner prices state and the optimizer step with. ``mixed``: Megatron-LM and
ZeRO's fp32 master and moments for 16-bit weights (Rajbhandari et al. 2019, §3.1, K = 12);
``runtime``: what `parallelize` holds with a torch optimizer of any number of moments,
which `state_bytes` counts per tensor: 16-bit parameters get an fp32 master and fp32 moments
(autopar.runtime.master), wider ones are their own master with moments of their dtype. For
AdamW the two are the same bytes. The free and the executable search both price ``mixed``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

FP32 = 4
ADAM_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq (Loshchilov & Hutter 2019)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each training state before any sharding."""

    weights: int  # the parameters as the model holds them
    gradients: int
    master: int  # an fp32 copy the optimizer updates; 0 where the weights are their own
    optimizer: int  # the optimizer's moments
    convention: str = "mixed"  # mixed | runtime (see the module docstring)
    # bytes per parameter ZeRO-3 all-gathers for the forward and backward (None: the
    # weights as held; 1 under fp8, which gathers float8 weights: autopar.cost.fp8)
    gathered: float | None = None

    @property
    def gather_ratio(self) -> float:
        """ZeRO-3's gathered bytes over the weights' bytes."""
        return 1.0 if self.gathered is None else self.gathered / self.weights

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master + self.optimizer

    @property
    def offloaded(self) -> int:
        """Bytes per parameter the host holds under ZeRO-Offload: the optimizer's copy of the
        weights (the master, else a copy of the weights), its moments and the gradient that
        comes down for the CPU step (Ren et al. 2021, arXiv 2101.06840, §4.1)."""
        return (self.master or self.weights) + self.optimizer + self.gradients

    @property
    def step_bytes(self) -> int:
        """Bytes one optimizer step moves per parameter: read the gradient, read and write
        the master and moments, write the weights (and read them where they are the master)."""
        return self.gradients + 2 * (self.master + self.optimizer) + \
            self.weights * (1 if self.master else 2)

    def text(self) -> str:
        parts = [f"weights {self.weights}", f"gradients {self.gradients}"]
        if self.master:
            parts.append(f"fp32 master {self.master}")
        parts.append(f"moments {self.optimizer}")
        gathered = "" if self.gathered is None else \
            f"; ZeRO-3 gathers {self.gathered:g} B/parameter"
        return f"{self.total} B/parameter = " + " + ".join(parts) + gathered

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Precision:
        return cls(**data)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def mixed(param_dtype: torch.dtype) -> Precision:
    """Mixed-precision AdamW as Megatron-LM and ZeRO run it: fp32 masters for 16-bit weights,
    fp32 moments."""
    e = itemsize(param_dtype)
    return Precision(e, e, FP32 if e < FP32 else 0, ADAM_MOMENTS * FP32, "mixed")


def runtime(param_dtype: torch.dtype, moments: int = ADAM_MOMENTS) -> Precision:
    """What the engine holds with a torch optimizer of `moments` states: a 16-bit parameter
    and gradient, an fp32 master and fp32 states (autopar.runtime.master); a parameter of
    fp32 or wider is its own master, its states of its dtype."""
    e = itemsize(param_dtype)
    return Precision(e, e, FP32 if e < FP32 else 0, moments * max(e, FP32), "runtime")


def precision_of(param_dtype: torch.dtype) -> Precision:
    """The planner's one rule, for the free and the executable search alike: mixed precision
    (16 bytes a parameter, what `parallelize(precision="bf16")` holds on fp32 masters, and
    what it holds under fp32)."""
    return mixed(param_dtype)
