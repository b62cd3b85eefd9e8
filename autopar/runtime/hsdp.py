"""Hybrid sharded data parallelism (HSDP; Zhao et al. 2023, PyTorch FSDP §3.2.2): ZeRO over
a shard group of neighbouring dp ranks, replicated over the groups (runtime.mesh's
`hybrid_groups` makes both). `ShardGroup` is what ZeRO runs on: gathers and reduce-scatters
inside the shard group, each reduce-scattered piece then summed over the replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.kernels.collectives import AxisGroup, Pending


class ShardGroup:
    """ZeRO's group under HSDP: size, rank, gathers and reduce-scatters of the shard group;
    a reduce-scatter's piece is then summed over the replicas (so ZeRO divides by
    `divisor`, the replica count, to make the mean over dp)."""

    def __init__(self, shard: AxisGroup, replicate: AxisGroup):
        self.shard, self.replicate = shard, replicate
        self.axis, self.size, self.rank, self.log = shard.axis, shard.size, shard.rank, shard.log
        self.divisor = replicate.size

    def all_gather(self, x: torch.Tensor, dim: int, groups: int, phase: str) -> torch.Tensor:
        return self.shard.all_gather(x, dim, groups, phase)

    def all_reduce(self, x: torch.Tensor, phase: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over the shard group alone (fp8's amaxes: its pieces make the whole weight)."""
        return self.shard.all_reduce(x, phase, op=op)

    def all_gather_async(self, flat: torch.Tensor, phase: str,
                         out: torch.Tensor | None = None) -> Pending:
        return self.shard.all_gather_async(flat, phase, out)

    def reduce_scatter(self, x: torch.Tensor, dim: int, groups: int,
                       phase: str) -> torch.Tensor:
        piece = self.shard.reduce_scatter(x, dim, groups, phase).contiguous()
        return self.replicate.all_reduce(piece, phase)

    def reduce_scatter_async(self, flat: torch.Tensor, phase: str) -> Pending:
        return _ThenOverReplicas(self.shard.reduce_scatter_async(flat, phase), self.replicate,
                                 phase)


class _ThenOverReplicas(Pending):
    """A shard group's reduce-scatter in flight; `.wait()` also sums the piece over the
    replicas (the all-reduce starts once the piece has landed)."""

    def __init__(self, pending: Pending, replicate: AxisGroup, phase: str):
        super().__init__(None, [])
        self._pending, self._replicate, self._phase = pending, replicate, phase

    def wait(self) -> torch.Tensor:
        if self._out is None:
            piece = self._pending.wait().contiguous()
            self._out = self._replicate.all_reduce(piece, self._phase)
        return self._out
