"""This rank's gradients after the backward: data-parallel averaging, global norms over
every shard (clipping, LAMB/LARS trust ratios) and fp16's overflow check."""

from __future__ import annotations

import torch
from torch import nn

from autopar.kernels.collectives import AxisGroup, CommLog, world_group
from autopar.runtime.buckets import GradientBuckets, average_gradients
from autopar.runtime.hsdp import ShardGroup
from autopar.runtime.params import ShardedParams
from autopar.runtime.zero import ZeroOne, ZeroTwo
from autopar.runtime.zero3 import ZeroThree
from autopar.runtime.zero_experts import expert_zero
from autopar.runtime.zero_state import ZeroState

# the one place a plan's ZeRO stage number becomes the family that runs it
ZERO_FAMILIES: dict[int, type[ZeroState]] = {1: ZeroOne, 2: ZeroTwo, 3: ZeroThree}


def zero_family(plan_zero) -> type[ZeroState] | None:
    """The ZeRO family a plan's `zero` asks for (None: no ZeRO)."""
    return ZERO_FAMILIES.get(plan_zero.stage)


def zero_sharded(plan_zero, dp_size: int) -> bool:
    """Whether the optimizer runs on ZeRO's pieces: over two or more dp ranks, or
    offloaded (one rank's piece is then the whole parameter, on the host)."""
    return zero_family(plan_zero) is not None and (dp_size > 1 or plan_zero.offload)


def make_zero(plan_zero, params, dp: AxisGroup, factory, compute_dtype, stages=None,
              experts=None, pieces=None, float8: bool = False):
    """The ZeRO state a plan's `zero` asks for over dp: the optimizer runs on this rank's
    pieces (stage 2 under a pipeline: `stages`, each stage's parameters). `experts`: a
    Gradients whose expert weights are cut over their expert-data group instead. `pieces`:
    ZeRO-3's pieces a start made already (id(parameter) -> piece), adopted as they are.
    `float8`: ZeRO-3 gathers float8 linears' weights in e4m3 (precision="fp8")."""
    family = zero_family(plan_zero)
    if experts is not None and experts.edp is not None:
        return expert_zero(family, plan_zero, params, dp, experts.edp, experts.expert_divisor,
                           experts.params.is_expert, factory, compute_dtype, stages, pieces)
    # under HSDP `dp` is a runtime.hsdp.ShardGroup: the sum it reduces spans its replicas
    divisor = dp.divisor if isinstance(dp, ShardGroup) else 1
    if family is ZeroThree:
        return ZeroThree(list(params), dp, factory, plan_zero.offload, compute_dtype,
                         pieces=pieces, divisor=divisor, float8=float8)
    extra = {"stages": stages} if family.reduces_in_backward else {}
    return family(list(params), dp, factory, offload=plan_zero.offload, divisor=divisor,
                  **extra)


class DataContextSum:
    """The gradient sync over dp x cp (one all-reduce, runtime.mesh.data_context_group) as
    a mean over dp: `size`, what the sum is divided by, is dp's; cp's ranks add the partial
    sums their tokens left."""

    def __init__(self, group: AxisGroup, dp: int):
        self.group, self.size = group, dp

    def all_reduce(self, t: torch.Tensor, phase: str) -> torch.Tensor:
        return self.group.all_reduce(t, phase)

    def all_reduce_async(self, t: torch.Tensor, phase: str):
        return self.group.all_reduce_async(t, phase)


class Gradients:
    """The gradient path of one engine, and the owner of its ZeRO state (`zero`, a
    runtime.zero_state.ZeroState) and pipeline runner (`pipeline`), which the engine reads
    from here; `buckets`: plain dp's GradientBuckets."""

    def __init__(self, params: ShardedParams, dp: AxisGroup, log: CommLog):
        self.params, self.dp, self.log = params, dp, log
        self.zero: ZeroState | None = None
        self.pipeline = None
        self.buckets = None
        self.edp: AxisGroup | None = None  # with an ep axis: the expert-data group ...
        self.ep_size = 1  # ... and the ep size
        self.expert_divisor = 1.0  # dp / edp: what the sum over edp is divided by, over edp
        self.world: AxisGroup | None = None  # every rank, as axis "world" (made when used)
        self.replicas = 1  # HSDP: how many shard groups hold the same ZeRO pieces
        # beside cp (a grid, no ZeRO, pipeline or experts): the sync over dp x cp, and the
        # parameters whole on cp (each cp rank's gradient the same), divided by cp after it
        self.sync: AxisGroup | DataContextSum = dp
        self.cp_size, self.whole_on_cp = 1, []

    def sum_over_cp(self, dp: AxisGroup, cp: AxisGroup) -> None:
        """Leave the parameters' sums over cp to the step: one all-reduce over dp x cp."""
        from autopar.runtime.mesh import data_context_group

        self.sync, self.cp_size = DataContextSum(data_context_group(dp, cp), dp.size), cp.size

    @property
    def cp_grads(self) -> bool:
        """Whether the graph sums the parameters' gradients over cp (solve's cp_grads)."""
        return self.cp_size == 1

    @property
    def sync_ranks(self) -> int:
        """The ranks the gradient sync spans (dp, or dp x cp)."""
        return self.sync.group.size if isinstance(self.sync, DataContextSum) else self.dp.size

    def make_buckets(self, gm, solution) -> GradientBuckets | None:
        """Plain data parallelism's buckets over the sync's ranks (None with one); beside cp,
        the parameters `solution` read whole on cp are noted first."""
        if not self.cp_grads:
            partial = {id(gm.get_parameter(t)) for t in solution.cp_partial}
            self.whole_on_cp = [p for p in self.data_parameters() if id(p) not in partial]
        if self.sync_ranks == 1:
            return None
        return GradientBuckets(self.data_parameters(), self.sync)

    def _whole_on_cp_mean(self) -> None:
        for p in self.whole_on_cp:  # summed over cp's equal copies too
            if p.grad is not None:
                p.grad /= self.cp_size

    def split_experts(self, edp: AxisGroup, ep_size: int) -> None:
        """Expert weights (ShardedParams.is_expert) are averaged over `edp`, the data (x cp)
        ranks holding the same experts, not over dp. Each rank's expert gradient already
        sums the tokens of its ep group (the all-to-all's backward), so the sum over edp
        covers every data and cp rank once and is divided by dp = edp x ep / cp, as dp's
        mean of the rest (whose gradients the graph summed over cp) is."""
        self.edp, self.ep_size = edp, ep_size
        self.expert_divisor = self.dp.size / edp.size  # (ep / cp)

    def data_parameters(self) -> list[nn.Parameter]:
        """The local parameters averaged over dp (all but the experts under an ep axis)."""
        return [p for p in self.trained() if not self.params.is_expert(p)]

    def trained(self) -> list[nn.Parameter]:
        """The local parameters this rank trains (under a pipeline: its stages')."""
        return self.pipeline.parameters() if self.pipeline is not None else \
            self.params.parameters()

    def held(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient, its local parameter) for every gradient this rank's optimizer steps
        on: ZeRO pieces, or its (stages') whole local parameters."""
        if self.zero is not None:
            owners = self.zero.owners()
            return [(s.grad, owners[id(s)]) for s in self.zero.shards if s.grad is not None]
        return [(p.grad, p) for p in self.trained() if p.grad is not None]

    def average(self) -> None:
        """The mean over dp (ZeRO: of this rank's pieces only)."""
        if self.zero is not None:  # (one rank, offloaded: the host copies)
            self.zero.reduce_gradients()
            return
        if self.pipeline is not None and self.pipeline.data is not None:
            return  # (a pipeline without ZeRO averaged over dp in its step)
        if self.edp is not None:
            experts = [p for p in self.trained()
                       if self.params.is_expert(p) and p.grad is not None]
            if self.edp.size > 1:
                average_gradients(experts, self.edp, divisor=self.expert_divisor)
            for p in experts if self.edp.size == 1 and self.dp.size > 1 else ():
                p.grad /= self.dp.size  # ep = dp x cp: nothing to send
        if self.sync_ranks == 1:
            return
        if self.buckets is not None:
            self.buckets.finish()
        else:
            average_gradients(self.data_parameters(), self.sync)
        self._whole_on_cp_mean()

    def drop(self, optimizer) -> None:
        """Forget a skipped step's gradients: the parameters' and the ZeRO pieces'."""
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        for p in self.trained():
            p.grad = None
        for piece in self.zero.shards if self.zero is not None else ():
            piece.grad = None

    def step(self, optimizer, scaler, max_norm: float | None,
             norm_phase: str | None = None) -> float | None:
        """Clip and step, unless fp16 overflowed on some rank (then every rank skips);
        returns the global norm when clipping, or when `norm_phase` asks for it without
        clipping (its all-reduce logged in that phase), inf for a skipped step."""
        if self.overflowed(scaler):
            self.drop(optimizer)
            return float("inf") if max_norm is not None or norm_phase else None
        if max_norm is not None:
            norm = self.clip(max_norm)
        else:
            norm = self.global_norm(norm_phase) if norm_phase else None
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.zero is not None:
            self.zero.gather_parameters()
        return norm

    def with_norms(self, optimizer):
        """The optimizer, given whole-parameter norms when it asks (autopar.optim's LAMB
        and LARS)."""
        if optimizer is not None and hasattr(optimizer, "whole_norms"):
            optimizer.whole_norms = self.whole_norms
        return optimizer

    def sum_over_world(self, vec: torch.Tensor, phase: str = "step") -> torch.Tensor:
        """Sum `vec` over every rank in place (logged as an all-reduce on axis 'world')."""
        if self.world is None:
            self.world = world_group(self.log)
        out = self.world.all_reduce(vec, phase)
        if out is not vec:
            vec.copy_(out)
        return vec

    def copies(self, param: nn.Parameter) -> int:
        """On how many ranks the same gradient values of `param` lie: over the tensor axes,
        over dp (not under ZeRO, whose pieces differ) and over pipeline ranks sharing it."""
        copies = self.params.tensor_copies(param)
        if self.zero is None:
            copies *= self.edp.size if self.params.is_expert(param) else self.dp.size
        elif self.edp is None or not self.params.is_expert(param):
            copies *= self.replicas  # HSDP's replicas (the experts' pieces are over edp)
        if self.pipeline is not None:
            copies *= self.pipeline.copies(param)
        return copies

    def squares_once(self, t: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """This rank's share of the squared norm of `t` (a piece of `param` or of its
        gradient), so that the sum over the world counts each value once."""
        return t.detach().double().pow(2).sum() / self.copies(param)

    def global_norm(self, phase: str = "step") -> float:
        """The norm of every gradient over every shard, each value counted once (summed on
        the gradients' device: NCCL reduces only GPU tensors)."""
        held = self.held()
        device = held[0][0].device if held else torch.device("cpu")
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for grad, param in held:
            total += self.squares_once(grad, param)
        return float(self.sum_over_world(total, phase).sqrt())

    def clip(self, max_norm: float) -> float:
        """Scale every gradient by max_norm / (global norm + 1e-6) when below 1, as
        torch.nn.utils.clip_grad_norm_ does on one device; returns the global norm."""
        grads = self.held()
        norm = self.global_norm()
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grad, _ in grads:
                grad.mul_(coef)
        return norm

    def overflowed(self, scaler) -> bool:
        """fp16: unscale the held gradients and say whether any rank's hold an inf or a nan
        (updates the scale); False without a scaler."""
        if scaler is None:
            return False
        overflow = scaler.unscale_([g for g, _ in self.held()], self.sum_over_world)
        scaler.update(overflow)
        return overflow

    def whole_norms(self, params, tensors) -> list[torch.Tensor]:
        """For each optimizer parameter (a slice or a ZeRO piece of one), the norm of the
        whole tensor `tensors[i]` is this rank's piece of (autopar.optim's LAMB and LARS)."""
        owner = self.zero.owners() if self.zero is not None else {}
        index = self.params.norm_index
        slots = []
        vec = torch.zeros(len(index), dtype=torch.float64)
        for param, t in zip(params, tensors):
            local = owner.get(id(param), param)
            slot = index[self.params.name_of(local)]
            vec[slot] += self.squares_once(t, local)
            slots.append(slot)
        self.sum_over_world(vec)
        return [vec[slot].sqrt() for slot in slots]
