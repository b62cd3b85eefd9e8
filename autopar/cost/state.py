"""What a rank holds besides activations: parameters, gradients and optimizer state per
tensor as the runtime's optimizer keeps them (`state_bytes`), and the optimizer step's
temporaries (`step_workspace`, `optimizer_step_bytes`), by implementation (for-loop,
foreach, fused). `cost.memory` prices the activations."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

from autopar.cost.hardware import OPTIMIZER_IMPLEMENTATIONS
from autopar.cost.precision import runtime
from autopar.errors import PlanError
from autopar.graph.trace import TracedGraph
from autopar.sharding.layout import Layout


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def param_dtype(traced: TracedGraph) -> torch.dtype:
    """The floating dtype holding the most parameter elements (fp32 for a model without)."""
    count: dict[torch.dtype, int] = {}
    for p in traced.params.values():
        if p.is_parameter and p.dtype.is_floating_point:
            count[p.dtype] = count.get(p.dtype, 0) + int(math.prod(p.shape))
    return max(count, key=count.__getitem__, default=torch.float32)


def axis_sizes(solution) -> dict[str, int]:
    """Ranks per mesh axis of a solution (several axes under 2D, 2.5D and 3D)."""
    if solution is None:
        return {}
    sizes = getattr(solution, "sizes", None)
    return dict(sizes) if sizes else {solution.axis: solution.size}


def held_fraction(layout, sizes: dict[str, int]) -> Fraction:
    """The share of a tensor one device holds under `layout` (a partial sum is whole)."""
    parts = 1
    if isinstance(layout, Layout):
        for shard in layout.shards:
            parts *= sizes.get(shard.axis, 1)
    return Fraction(1, parts)


# ------------------------------------------------------------------------ model state
@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter tensor: buffers shaped like it, and scalars."""

    buffers: int  # tensors of the parameter's shape and dtype
    scalar_bytes: int  # bytes per parameter tensor


def _step_bytes() -> int:
    # torch.optim.Adam and AdamW keep `step` as a 0-dim tensor of the default float dtype
    # (on the CPU unless fused or capturable): 4 bytes per parameter tensor in float32.
    return torch.empty((), dtype=torch.get_default_dtype(), device="meta").element_size()


OPTIMIZERS: dict[str, Callable[[], OptimizerState]] = {
    "adamw": lambda: OptimizerState(2, _step_bytes()),  # exp_avg, exp_avg_sq, step
    "adam": lambda: OptimizerState(2, _step_bytes()),
    "adamw_amsgrad": lambda: OptimizerState(3, _step_bytes()),  # + max_exp_avg_sq
    "sgd_momentum": lambda: OptimizerState(1, 0),  # momentum_buffer
    "sgd": lambda: OptimizerState(0, 0),
    "lamb": lambda: OptimizerState(2, 0),  # autopar.optim.LAMB: exp_avg, exp_avg_sq, int step
    "lars": lambda: OptimizerState(1, 0),  # autopar.optim.LARS: momentum_buffer
}


@dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds across steps: weights, gradients, optimizer state, buffers."""

    parameters: int
    gradients: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers

    def to_json(self) -> dict:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer, "buffers": self.buffers, "total": self.total}


def state_bytes(traced: TracedGraph, solution=None, optimizer: str = "adamw", zero_stage: int = 0,
                dp: int = 1, grad_dtype: torch.dtype | None = None) -> StateBytes:
    """Parameter, gradient, optimizer-state and buffer bytes one device holds.

    Parameters and buffers are split as `solution.params` lays them out (whole without a
    solution); a tied weight counts once. Only trainable floating-point parameters have
    gradients (of their own dtype unless `grad_dtype`) and optimizer state (see
    OPTIMIZERS). ZeRO over `dp` data-parallel ranks splits the optimizer state (stage 1),
    also the gradients (stage 2), also the parameters (stage 3); each rank's share is
    rounded up, as a flat buffer padded to `dp` equal parts would be.

    Mixed precision: `parallelize(precision="bf16" | "fp16")` on an fp32 model keeps its
    fp32 parameters as the optimizer's masters and gives them fp32 gradients
    (autopar.passes.precision), so this function on the fp32 trace is what such a run
    holds across steps (4 + 4 bytes a parameter, plus fp32 moments); the 16-bit casts of
    the weights live from their layer's forward to its backward, like activations. A model
    whose parameters are bf16 or fp16 (what the CLI's `--dtype bf16` traces) holds them
    and their gradients in 16 bits, and the optimizer an fp32 master and fp32 moments
    (autopar.runtime.master): 2 + 2 + 4 + 8 bytes a parameter under AdamW, the planner's
    `autopar.cost.precision.mixed`. This is `autopar.cost.precision.runtime` per
    parameter. Either way the gradients are reduced in the parameters' dtype, as the
    search prices the data-parallel traffic.
    """
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r} is unknown to the memory model; use one of "
                        f"{', '.join(OPTIMIZERS)}.")
    if zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"ZeRO stage {zero_stage} does not exist; use 0, 1, 2 or 3.")
    if dp < 1:
        raise PlanError(f"dp={dp}: the data-parallel size must be at least 1.")
    opt = OPTIMIZERS[optimizer]()
    sizes = axis_sizes(solution)
    params = grads = states = buffers = Fraction(0)
    seen: set[tuple[str, ...]] = set()
    for target, pinfo in traced.params.items():
        if pinfo.names in seen:
            continue
        seen.add(pinfo.names)
        layout = solution.params.get(target) if solution is not None else None
        numel = math.prod(pinfo.shape) * held_fraction(layout, sizes)
        nbytes = numel * _itemsize(pinfo.dtype)
        if not pinfo.is_parameter:
            buffers += nbytes
            continue
        params += nbytes
        if _trainable(traced, target, pinfo):
            held = runtime(pinfo.dtype, moments=opt.buffers)
            grads += numel * (_itemsize(grad_dtype) if grad_dtype else held.gradients)
            states += numel * (held.master + held.optimizer) + opt.scalar_bytes
    split = {stage: dp if zero_stage >= stage else 1 for stage in (1, 2, 3)}
    return StateBytes(parameters=math.ceil(params / split[3]),
                      gradients=math.ceil(grads / split[2]),
                      optimizer=math.ceil(states / split[1]), buffers=math.ceil(buffers))


def _trainable(traced: TracedGraph, target: str, pinfo) -> bool:
    if not pinfo.dtype.is_floating_point:
        return False
    value = traced.gm
    for part in target.split("."):
        value = getattr(value, part)
    return bool(getattr(value, "requires_grad", True))


# ------------------------------------------------------------------------ optimizer step
# torch.optim's three implementations of a step: a Python loop over the tensors (torch's
# default on the CPU), foreach kernels over each device and dtype's tensor list (its
# default where every tensor is on CUDA or a device like it) and fused kernels (opt-in)
FOR_LOOP, FOREACH, FUSED = OPTIMIZER_IMPLEMENTATIONS

# how each implementation's temporaries are priced, as explain names it
STEP_SOURCE = {
    FOR_LOOP: "torch.optim.adam._single_tensor_adam: the square root and quotient of "
              "exp_avg_sq for one tensor at a time, beside the previous tensor's denom "
              "(2 x its state + the one before it, the largest such pair)",
    FOREACH: "torch.optim.adam._multi_tensor_adam: _foreach_sqrt copies every exp_avg_sq "
             "of the group at once (torch.optim docs: foreach's intermediates are a "
             "tensorlist, more peak memory)",
    FUSED: "fused kernels: no temporaries",
}


@dataclass(frozen=True)
class StepTemps:
    """The for-loop AdamW step's temporaries over a run of tensors, in the order it steps
    them (torch.optim.adam._single_tensor_adam): `denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)` holds tensor i's square root and quotient at once,
    while the previous tensor's `denom` is still bound, so the step peaks at
    max_i(2 s_i + s_{i-1}) bytes of state. `peak` is that maximum within the run, `first`
    and `last` the bytes of its end tensors; `then` joins two runs."""

    peak: float = 0.0
    first: float = 0.0
    last: float = 0.0

    @classmethod
    def of(cls, sizes) -> StepTemps:
        peak, prev = 0, 0
        for s in sizes:
            peak, prev = max(peak, 2 * s + prev), s
        return cls(peak, sizes[0] if len(sizes) else 0, prev)

    def then(self, other: StepTemps) -> StepTemps:
        if not self.peak:
            return other
        if not other.peak:
            return self
        return StepTemps(max(self.peak, other.peak, 2 * other.first + self.last), self.first,
                         other.last)

    def scaled(self, k: float) -> StepTemps:
        return StepTemps(self.peak * k, self.first * k, self.last * k)


def step_workspace(tensors, optimizer: str = "adamw", implementation: str = FOR_LOOP,
                   scalar_bytes: int = 4) -> int:
    """Peak bytes of the temporaries one `step()` allocates beyond the parameters, gradients
    and state (any step after the first, which also makes the state), for `tensors`: the
    bytes of each parameter's state tensor (one moment, in the parameter's dtype) in the
    order the optimizer steps them, one param group on one device and dtype. Measured on
    the CPU against each rule (tests/test_memory_step.py), defaults of each class:

    * adamw, adam, adamw_amsgrad: for-loop `StepTemps`; foreach, one copy of every tensor
      (`_foreach_sqrt`); fused, none. (Adam's coupled weight decay and `maximize` copy each
      gradient too, one tensor more: not priced.)
    * sgd, sgd_momentum: in place, none (weight decay or Nesterov would copy the gradient).
    * lamb (`autopar.optim.LAMB`, bias correction on, no weight decay): every update is kept
      until the trust ratios are known, each made from m_hat, v_hat and a denominator:
      max_i(sum_{j<i} s_j + 4 s_i), then every update and two norms per tensor.
    * lars (`autopar.optim.LARS`): g + weight_decay x w, two tensors of the parameter's
      size, beside two norms per tensor.
    """
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r} is unknown to the memory model; use one of "
                        f"{', '.join(OPTIMIZERS)}.")
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise PlanError(f"optimizer implementation {implementation!r} does not exist; use one "
                        f"of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}.")
    sizes = [int(s) for s in tensors]
    if not sizes or optimizer.startswith("sgd") or implementation == FUSED:
        return 0
    norms = 2 * len(sizes) * scalar_bytes
    if optimizer == "lamb":
        before, peak = 0, 0
        for s in sizes:
            peak, before = max(peak, before + 4 * s), before + s
        return max(peak, before + norms)
    if optimizer == "lars":
        return 2 * max(sizes) + norms
    return sum(sizes) if implementation == FOREACH else int(StepTemps.of(sizes).peak)


def optimizer_step_bytes(traced: TracedGraph, solution=None, optimizer: str = "adamw",
                         implementation: str = FOR_LOOP, zero_stage: int = 0, dp: int = 1,
                         offload: bool = False) -> int:
    """`step_workspace` on one device: its trainable parameters' pieces in the traced order
    (the engine's optimizer holds them in the order its graphs first read them), split as
    `solution.params` lays them out and, under ZeRO (any stage: the optimizer steps 1/dp of
    each parameter), cut into ceil(n / dp) pieces. Offloaded, the step runs on the host and
    its temporaries take no device memory: 0."""
    if offload:
        return 0
    sizes = axis_sizes(solution)
    pieces, seen, itemsize = [], set(), 4
    for target, pinfo in traced.params.items():
        if pinfo.names in seen or not pinfo.is_parameter or \
                not _trainable(traced, target, pinfo):
            continue
        seen.add(pinfo.names)
        layout = solution.params.get(target) if solution is not None else None
        numel = math.ceil(math.prod(pinfo.shape) * held_fraction(layout, sizes))
        itemsize = _itemsize(pinfo.dtype)
        pieces.append((-(-numel // dp) if zero_stage else numel) * itemsize)
    return step_workspace(pieces, optimizer, implementation, itemsize)
