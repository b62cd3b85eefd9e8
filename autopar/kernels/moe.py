"""Expert parallelism for the dropless MoE layer: experts split over an `ep` axis, tokens sent
to their experts' ranks by all-to-all with variable sizes, and back.

`MoE` is `autopar.kernels.sparse_moe.SparseMoE` (router, sorted dispatch, SwiGLU experts, combine in
slot order) with its E experts split over the members of an `AxisGroup`: member r holds
experts r*E/ep ... (r+1)*E/ep - 1. Each member routes its own tokens, sorts the token-expert
pairs by expert and then (GShard, Lepikhin et al. 2020; dropless as Megablocks, Gale et al.
2022, so no capacity factor and no dropped token):

1. all-to-all of the per-expert row counts (E/ep integers to each member);
2. all-to-all of the rows with those split sizes (`all_to_all_single`, which gloo runs with
   uneven splits in torch 2.13);
3. the received rows, grouped by source member, regrouped by local expert; the experts run;
4. the inverse regrouping and the inverse all-to-all; the combine on the token's own member.

The backward of each row all-to-all is the inverse all-to-all of the gradients (`_AllToAllV`),
so expert weight gradients are sums over every token of the group, as on one device. The
balance loss is taken from counts and probabilities summed over `aux_group` (the ranks that
split the batch), so it equals the one-device value over the whole batch; under a pipeline
`ScheduleBalance` takes its derivative over the step's micro-batches too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.kernels.collectives import AxisGroup, CommLog, copy_to_region, reduce_from_region
from autopar.kernels.routing import Routing, balance_loss, balance_stats
from autopar.kernels.sparse_moe import SparseMoE, is_eager
from autopar.modes import EP


def axis_group(group, axis: str = EP) -> AxisGroup | None:
    """An AxisGroup for `group`: an AxisGroup (returned as is), a torch process group (logged
    to a fresh CommLog) or None."""
    if group is None or isinstance(group, AxisGroup):
        return group
    return AxisGroup(axis, dist.get_world_size(group), dist.get_rank(group), group, CommLog())


def all_to_all_v(g: AxisGroup, x: torch.Tensor, send: list[int], recv: list[int],
                 phase: str) -> torch.Tensor:
    """Rows send[j] of x (in member order) go to member j; the rows received from members
    0..size-1 (recv[j] from j) are concatenated. Logs op "all_to_all" with the bytes this rank
    sends (its whole buffer, its own share included, as `AxisGroup.all_to_all` logs)."""
    return g.all_to_all_v(x, send, recv, phase)


class _AllToAllV(torch.autograd.Function):
    """Dispatch rows by variable all-to-all; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, g: AxisGroup, send: list[int], recv: list[int]):
        ctx.g, ctx.send, ctx.recv = g, send, recv
        return all_to_all_v(g, x, send, recv, "forward")

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_v(ctx.g, grad, ctx.recv, ctx.send, "backward"), None, None, None


class _SumOverBatch(torch.autograd.Function):
    """All-reduce (sum) of statistics over the ranks that split the batch. The backward sums
    the gradients as well: the exact derivative when the objective adds the ranks' losses,
    and, under data parallelism's mean of losses and of gradients, what makes a loss that
    every rank computes on the global sums get the one-device gradient. `replicas`: ranks of
    the group that each add the same loss to gradients summed over them (cp ranks, whose
    weights' gradients are summed over cp): the backward's sum is divided by it."""

    @staticmethod
    def forward(ctx, x, g: AxisGroup, replicas: int = 1):
        ctx.g, ctx.replicas = g, replicas
        return g.all_reduce(x.clone(), "forward")

    @staticmethod
    def backward(ctx, grad):
        out = ctx.g.all_reduce(grad.clone(), "backward")
        return (out / ctx.replicas if ctx.replicas > 1 else out), None, None


def global_balance_loss(routing: Routing, group: AxisGroup | None = None,
                        schedule: ScheduleBalance | None = None,
                        replicas: int = 1) -> torch.Tensor:
    """Switch Transformer's balance loss (Fedus et al. 2021, eq. 4) from counts and
    probabilities summed over `group`: the one-device value over the whole batch (with
    `schedule`, over the micro-batches of a pipeline step too, in its gradient; `replicas`:
    the cp ranks of a group over dp x cp, see _SumOverBatch)."""
    stats = balance_stats(routing)
    if group is not None:
        stats = _SumOverBatch.apply(stats, group, replicas)
    if schedule is not None:
        return _OverSchedule.apply(stats, schedule)
    return balance_loss(stats)


class ScheduleBalance:
    """One MoE layer's balance statistics over the micro-batches of a pipeline step.

    One device takes the loss E * sum_e f_e P_e over the whole batch (f_e from the counts,
    not differentiated; P_e the mean router probability). A micro-batch's forward gives
    the value from its own statistics (summed over the data ranks); its backward, which
    under a schedule that runs every forward of a stage before its backwards comes after
    all of them, gives the derivative from the step's totals, d/dP-sums = w E C_e / N^2,
    times the micro-batches (the runner averages over them) for the loss's weight w that
    arrives as the output's gradient. `correction` is what the micro-batches' mean of
    losses then lacks to be the one-device loss."""

    def __init__(self, microbatches: int):
        self.microbatches = microbatches
        self.stats: list[torch.Tensor] = []  # per micro-batch forward, over the data ranks
        self.weights: list[torch.Tensor] = []  # per micro-batch backward: d loss / d value

    def reset(self) -> None:
        self.stats, self.weights = [], []

    def total(self) -> torch.Tensor:
        if len(self.stats) != self.microbatches:
            raise RuntimeError(f"a balance loss's backward ran after {len(self.stats)} of "
                               f"{self.microbatches} micro-batches' forwards; only a schedule "
                               "that runs every forward of a stage first makes it exact.")
        return torch.stack(self.stats).sum(0)

    def correction(self, loss_scale: float = 1.0) -> float:
        """The one-device loss minus the mean over micro-batches of theirs, for a loss that
        adds this layer's balance loss times a weight (the weight its backward received)."""
        if not self.weights:
            return 0.0
        whole = balance_loss(self.total().double())
        out = sum(float(w) / loss_scale * float(whole - balance_loss(s.double()))
                  for w, s in zip(self.weights, self.stats))
        return out / self.microbatches

    def constant_weight(self) -> bool:
        """Whether every micro-batch's backward received the same weight (a loss that adds
        the balance loss times a constant; anything else has no exact step-wide form)."""
        w = self.weights
        return all(torch.allclose(v, w[0], rtol=1e-6, atol=0) or not torch.isfinite(v).all()
                   for v in w)


class StepBalance:
    """The balance losses of a pipeline member's MoE layers over one step: called with the
    loss scale after the schedule, (what the mean over micro-batches of the losses lacks,
    whether the loss weighs each by a constant)."""

    refusal = ("the loss weighs the MoE balance loss by something other than a constant (its "
               "gradient differs between micro-batches), which a pipeline cannot take "
               "exactly; add it times a constant weight, or drop pipeline= from the plan.")

    def __init__(self, layers: list[ScheduleBalance]):
        self.layers = layers

    def __call__(self, loss_scale: float = 1.0) -> tuple[float, bool]:
        return (sum(b.correction(loss_scale) for b in self.layers),
                all(b.constant_weight() for b in self.layers))


class _OverSchedule(torch.autograd.Function):
    """A micro-batch's balance loss: its own value forward, the whole step's derivative
    backward (see ScheduleBalance)."""

    @staticmethod
    def forward(ctx, stats, schedule: ScheduleBalance):
        ctx.schedule = schedule
        schedule.stats.append(stats.detach().clone())
        return balance_loss(stats)

    @staticmethod
    def backward(ctx, grad):
        schedule = ctx.schedule
        schedule.weights.append(grad.detach().clone())
        total = schedule.total()
        experts = (total.numel() - 1) // 2
        out = torch.zeros_like(total)
        out[experts:2 * experts] = grad * schedule.microbatches * experts * \
            total[:experts] / total[-1] ** 2
        return out, None


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """counts [P, L] (rows from member s for local expert e, received member-major) -> the
    permutation that lists the rows expert-major, members in order within each expert."""
    members, local = counts.shape
    segment = torch.repeat_interleave(torch.arange(members * local, device=counts.device),
                                      counts.reshape(-1))
    key = (segment % local) * members + segment // local
    return torch.argsort(key, stable=True)


class MoE(SparseMoE):
    """Dropless top-k MoE (SwiGLU experts [E, ...]) with its experts split over `ep`.

    `ep`: an AxisGroup, a torch process group or None (one device: every expert here).
    `aux_group`: the ranks the batch is split over, for the balance loss (default: `ep`);
    `aux_replicas`: how many of them hold the same samples (cp ranks splitting their tokens).
    `tp`: an AxisGroup whose ranks each hold 1/tp of every expert's FFN width (w1, w3 rows
    and w2 columns of F; the shared expert's likewise), all with the same tokens: the experts'
    input is Megatron's f (gradient summed over tp) and their output rows its g (partial
    sums all-reduced) before the combine, so the router's gradient is exact; None: whole.
    Weights: the router and shared experts whole on every member, w1/w3/w2 the E/ep local
    experts. `last_tokens_per_expert`: rows each local expert computed in the last forward;
    `last_routed`: this rank's tokens per expert (all E) in that forward. With ep > 1 it
    runs eagerly only: the split sizes of its all-to-all are data (plans trace `SparseMoE`).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, *, ep=None,
                 aux_group=None, tp: AxisGroup | None = None, aux_replicas: int = 1,
                 **options):
        ep = axis_group(ep)
        size = 1 if ep is None else ep.size
        if experts % size:
            raise ValueError(f"{experts} experts do not split over ep={size} ranks; choose an "
                             "expert-parallel size that divides the number of experts.")
        super().__init__(hidden, ffn, experts, top_k, local_experts=experts // size, **options)
        self.ep = ep
        self.aux_group = ep if aux_group is None else axis_group(aux_group)
        self.aux_replicas = aux_replicas
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.first_expert = 0 if ep is None else ep.rank * (experts // size)
        self.last_routed: torch.Tensor | None = None
        # under a pipeline: the step's statistics over its micro-batches (ScheduleBalance)
        self.schedule: ScheduleBalance | None = None

    @classmethod
    def shard(cls, full: SparseMoE, ep, aux_group=None) -> MoE:
        """This member's part of a whole layer: router and shared experts copied, the local
        experts' slices of w1, w3, w2."""
        hidden, ffn = full.w1.size(2), full.w1.size(1)
        shared = full.shared_expert.w1.out_features if full.shared_expert is not None else 0
        with torch.device(full.w1.device):
            out = cls(hidden, ffn, full.num_experts, full.top_k, ep=ep, aux_group=aux_group,
                      router=full.router, shared_ffn=shared, gate_bias=full.gate.bias is not None,
                      shared_gate=full.shared_gate is not None)
        out = out.to(full.w1.dtype)
        local = slice(out.first_expert, out.first_expert + out.w1.size(0))
        state = {k: (v[local] if k in ("w1", "w3", "w2") else v)
                 for k, v in full.state_dict().items()}
        out.load_state_dict(state)
        return out

    def enter_experts(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else copy_to_region(x, self.tp)

    def leave_experts(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.tp is None else reduce_from_region(y, self.tp)

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if is_eager(xs):
            self.last_routed = counts.detach().clone()
        if self.ep is None or self.ep.size == 1:
            return super().run_experts(xs, counts)
        ep, local = self.ep, self.w1.size(0)
        by_member = counts.view(ep.size, local)  # (P, L) rows this rank sends
        received = ep.all_to_all(by_member, 0, 0, "forward")  # (P, L) rows it will get
        send, recv = by_member.sum(1).tolist(), received.sum(1).tolist()
        xr = _AllToAllV.apply(xs, ep, send, recv)  # member-major
        order = _expert_major(received)
        ye = super().run_experts(xr.index_select(0, order), received.sum(0))
        yr = ye.index_select(0, torch.argsort(order))
        return _AllToAllV.apply(yr, ep, recv, send)

    def balance_loss(self, routing: Routing) -> torch.Tensor:
        return global_balance_loss(routing, self.aux_group, self.schedule, self.aux_replicas)
