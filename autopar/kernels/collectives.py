"""Autograd-aware collectives on one mesh axis, each logging what it sends.

The six conjugate pairs of `autopar.sharding.redistribute` as autograd Functions, plus the
`Redistribute` module the rewrite pass puts into graphs. A split dimension with `groups`
blocks is handled blockwise: the rank's slice is its part of every block. `AxisGroup` also
runs the all-to-all and the ring shifts (logged as "p2p") of the sequence-parallel kernels in
`autopar.kernels.sequence`, the asynchronous gradient collectives of data parallelism and
ZeRO, the experts' uneven all-to-all, and logs the point-to-point sends torch's pipeline
schedule issues (`AxisGroup.sent`).

This module is the one place in `autopar.runtime` and `autopar.kernels` that calls
torch.distributed's communication functions (tests/test_comm_complete.py checks it): every
collective on model values goes through an `AxisGroup` and is logged with its op, axis and
bytes; the few exchanges of small Python objects by which ranks agree (`exchange_objects`,
`broadcast_object`) are control traffic, outside the step's accounting (docs/communication.md).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from autopar.sharding.layout import block_count

PHASES = ("forward", "backward", "step", "init")

# One flat tensor gathered / reduce-scattered: torch 2.13 names them *_single; the older
# names (the same signature, in every torch this package supports) where those are missing.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or \
    dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    op: str
    axis: str
    bytes: int
    phase: str
    layer: str | None = None  # the layer running when it was sent (see runtime.measure)


@dataclass
class CommLog:
    """Every collective run, in order: op, mesh axis, payload bytes, phase, the layer that
    ran it and (`seconds`, one per record) how long the call blocked this rank: the whole
    collective for the blocking ones of `AxisGroup`, 0 for those started asynchronously
    (ZeRO buckets, ring shifts, pipeline sends), whose wait overlaps compute."""

    records: list[CommRecord] = field(default_factory=list)
    enabled: bool = True
    seconds: list[float] = field(default_factory=list)
    recorder: object | None = None  # a runtime.measure.Recorder naming the running layer
    divert: "CommLog | None" = None  # while set, records go there instead (`diverted`)

    def add(self, op: str, axis: str, nbytes: int, phase: str) -> None:
        if self.divert is not None:
            self.divert.add(op, axis, nbytes, phase)
        elif self.enabled:
            layer = self.recorder.layer if self.recorder is not None else None
            self.records.append(CommRecord(op, axis, int(nbytes), phase, layer))
            self.seconds.append(0.0)

    def took(self, start: float) -> None:
        """The last record's call began at `start` (perf_counter) and has just returned."""
        if self.divert is not None:
            self.divert.took(start)
        elif self.enabled and self.seconds:
            self.seconds[-1] = time.perf_counter() - start

    @contextlib.contextmanager
    def diverted(self, other: "CommLog"):
        """Within the block, what is logged here goes to `other` (the engine's startup log
        takes the pipeline's weight fetch this way, whichever axis group sends it)."""
        before, self.divert = self.divert, other
        try:
            yield
        finally:
            self.divert = before

    def clear(self) -> None:
        self.records.clear()
        self.seconds.clear()

    def totals(self, phases=None) -> dict[tuple[str, str], int]:
        """Bytes per (op, axis), over the given phases (all by default)."""
        out: dict[tuple[str, str], int] = {}
        for r in self.records:
            if phases is None or r.phase in phases:
                out[(r.op, r.axis)] = out.get((r.op, r.axis), 0) + r.bytes
        return out

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


@dataclass
class AxisGroup:
    """One mesh axis as seen from this rank: its process group, size, index and the log."""

    axis: str
    size: int
    rank: int
    group: object | None  # torch ProcessGroup; None when size == 1
    log: CommLog

    def all_reduce(self, x: torch.Tensor, phase: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        start = time.perf_counter()
        x = x.contiguous()
        self.log.add("all_reduce", self.axis, x.numel() * x.element_size(), phase)
        if self.size > 1:
            dist.all_reduce(x, op=op, group=self.group)
            self.log.took(start)
        return x

    def all_gather(self, x: torch.Tensor, dim: int, groups: int, phase: str,
                   zigzag: bool = False) -> torch.Tensor:
        """The whole of a dim split over this axis (in `groups` blocks; `zigzag`: each block
        halved, member r holding chunks r and 2c-1-r of its 2c)."""
        start = time.perf_counter()
        x = x.contiguous()
        self.log.add("all_gather", self.axis, x.numel() * x.element_size() * self.size, phase)
        if self.size == 1:
            return x
        out = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.reshape(-1), group=self.group)
        out = _interleave(out.view((self.size,) + tuple(x.shape)), dim, groups, zigzag)
        self.log.took(start)
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int, groups: int, phase: str,
                       zigzag: bool = False) -> torch.Tensor:
        start = time.perf_counter()
        self.log.add("reduce_scatter", self.axis, x.numel() * x.element_size(), phase)
        if self.size == 1:
            return x
        stacked = _deinterleave(x, dim, groups, self.size, zigzag).contiguous()
        out = torch.empty(stacked[0].numel(), dtype=x.dtype, device=x.device)
        _reduce_scatter_single(out, stacked.reshape(-1), group=self.group)
        self.log.took(start)
        return out.view(stacked.shape[1:])

    def broadcast(self, x: torch.Tensor, src: int, phase: str) -> torch.Tensor:
        """Member `src` (an index within this axis) sends `x` to every member of the axis.

        Every member passes a tensor of the same shape and dtype; on the others it is a buffer
        that is overwritten in place (after `.contiguous()`) and returned. Logs the tensor's
        bytes on every member, the sender included, as the other methods log even at size 1.
        """
        start = time.perf_counter()
        x = x.contiguous()
        self.log.add("broadcast", self.axis, x.numel() * x.element_size(), phase)
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, src), group=self.group)
            self.log.took(start)
        return x

    def reduce(self, x: torch.Tensor, dst: int, phase: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce `x` (sum by default) over the axis into member `dst` (an index within it).

        Works in place on `x.contiguous()` and returns it; only member `dst` may read the
        result (the others hold unspecified values). Logs the tensor's bytes on every member.
        """
        start = time.perf_counter()
        x = x.contiguous()
        self.log.add("reduce", self.axis, x.numel() * x.element_size(), phase)
        if self.size > 1:
            dist.reduce(x, dst=dist.get_global_rank(self.group, dst), op=op, group=self.group)
            self.log.took(start)
        return x

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int,
                   phase: str) -> torch.Tensor:
        """Cut `x` into `size` equal slices along `scatter_dim` and send slice j to member j;
        the slices received from members 0..size-1 are concatenated along `gather_dim`, in
        member order. Logs the bytes of `x` (this rank's whole buffer, which equals what it
        receives), at size 1 too.
        """
        start = time.perf_counter()
        self.log.add("all_to_all", self.axis, x.numel() * x.element_size(), phase)
        if self.size == 1:
            return x
        if x.shape[scatter_dim] % self.size:
            raise ValueError(f"all_to_all on axis '{self.axis}': dim {scatter_dim} of a tensor "
                             f"of shape {list(x.shape)} does not split into {self.size} equal "
                             "slices")
        send = _deinterleave(x, scatter_dim, 1, self.size).contiguous()  # [P, ..., m, ...]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        out = _interleave(recv, gather_dim, 1)
        self.log.took(start)
        return out

    def shift(self, x: torch.Tensor, offset: int, phase: str, tag: int = 0) -> torch.Tensor:
        """Ring shift: send `x` to member (rank + offset) % size and return what member
        (rank - offset) % size sent (same shape and dtype on every member). Logs op "p2p"
        with the bytes this rank sends, at size 1 too (where `x` itself comes back).
        """
        return self.shift_async(x, offset, phase, tag).wait()

    def shift_async(self, x: torch.Tensor, offset: int, phase: str,
                    tag: int = 0) -> "Pending":
        """`shift` started without waiting: `.wait()` on the result returns the received
        tensor. `x` must not be modified before then. Shifts in flight at the same time
        between the same members should carry distinct `tag`s.
        """
        x = x.contiguous()
        self.log.add("p2p", self.axis, x.numel() * x.element_size(), phase)
        if self.size == 1 or offset % self.size == 0:
            return Pending(x, [])
        dst = dist.get_global_rank(self.group, (self.rank + offset) % self.size)
        src = dist.get_global_rank(self.group, (self.rank - offset) % self.size)
        out = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dst, self.group, tag),
                                        dist.P2POp(dist.irecv, out, src, self.group, tag)])
        return Pending(out, works)

    def all_reduce_async(self, x: torch.Tensor, phase: str) -> "Pending":
        """`all_reduce` (a sum, in place on `x`, which must be contiguous) started without
        waiting: `.wait()` on the result returns `x` summed. Logged with no blocking time."""
        self.log.add("all_reduce", self.axis, x.numel() * x.element_size(), phase)
        if self.size == 1:
            return Pending(x, [])
        return Pending(x, [dist.all_reduce(x, group=self.group, async_op=True)])

    def reduce_scatter_async(self, flat: torch.Tensor, phase: str) -> "Pending":
        """Sum a flat, contiguous buffer of `size` equal pieces over the axis; `.wait()`
        returns this member's piece of the sum (a new tensor). Logs the whole buffer's bytes."""
        self.log.add("reduce_scatter", self.axis, flat.numel() * flat.element_size(), phase)
        if self.size == 1:
            return Pending(flat, [])
        out = torch.empty(flat.numel() // self.size, dtype=flat.dtype, device=flat.device)
        return Pending(out, [_reduce_scatter_single(out, flat, group=self.group,
                                                        async_op=True)])

    def all_gather_async(self, flat: torch.Tensor, phase: str,
                         out: torch.Tensor | None = None) -> "Pending":
        """Every member's flat, contiguous piece, concatenated in member order; `.wait()`
        returns the whole buffer (`out`, a flat buffer of `size` pieces, when given). Logs
        the gathered bytes (the piece's times `size`)."""
        self.log.add("all_gather", self.axis, flat.numel() * flat.element_size() * self.size,
                     phase)
        if out is None:
            out = torch.empty(self.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        if self.size == 1:
            out.copy_(flat)
            return Pending(out, [])
        return Pending(out, [_all_gather_single(out, flat, group=self.group,
                                                    async_op=True)])

    def all_to_all_v(self, x: torch.Tensor, send: list[int], recv: list[int],
                     phase: str) -> torch.Tensor:
        """Rows send[j] of x (in member order) go to member j; the rows received from members
        0..size-1 (recv[j] from j) are concatenated. Logs op "all_to_all" with the bytes this
        rank sends (its whole buffer, its own share included, as `all_to_all` logs)."""
        start = time.perf_counter()
        x = x.contiguous()
        self.log.add("all_to_all", self.axis, x.numel() * x.element_size(), phase)
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        self.log.took(start)
        return out

    def sent(self, tensors, phase: str) -> None:
        """Log op "p2p" for each tensor this member hands to a point-to-point send that
        another library issues on this axis (torch's pipeline schedule batches its stages'
        sends itself): the bytes this rank sends, as `shift` logs them. Receives are not
        logged; the member that sends them logs them."""
        for t in tensors:
            self.log.add("p2p", self.axis, t.numel() * t.element_size(), phase)

    def subgroup(self, group) -> "AxisGroup":
        """The process group `group` of some of this axis's members (this rank among them),
        logged to the same log under the same axis name (a tied parameter's copies on some
        of the pipeline's members)."""
        return AxisGroup(self.axis, dist.get_world_size(group), dist.get_rank(group), group,
                         self.log)

    def local_slice(self, x: torch.Tensor, dim: int, groups: int,
                    zigzag: bool = False) -> torch.Tensor:
        if self.size == 1:
            return x
        return _deinterleave(x, dim, groups, self.size, zigzag)[self.rank].contiguous()


class Pending:
    """A collective in flight (`AxisGroup.shift_async` and the `*_async` methods)."""

    def __init__(self, out: torch.Tensor, works: list):
        self._out, self._works = out, works

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works = []
        return self._out


def world_group(log: CommLog) -> AxisGroup:
    """The whole world as one axis, "world" (norms and fp16's overflow flag are summed over
    every rank); size 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return AxisGroup("world", 1, 0, None, log)
    return AxisGroup("world", dist.get_world_size(), dist.get_rank(), dist.group.WORLD, log)


def exchange_objects(obj, group=None) -> list:
    """Control traffic, not logged: every member's picklable `obj`, in member order (over
    the world by default; [obj] without torch.distributed). For what ranks agree on (plan
    digests, errors, group membership, batch fingerprints), never for model values."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def broadcast_object(obj, src: int = 0, group=None):
    """Control traffic, not logged: global rank `src`'s picklable `obj` on every member of
    `group` (the world by default)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _interleave(stacked: torch.Tensor, dim: int, groups: int,
                zigzag: bool = False) -> torch.Tensor:
    """[P, ..., g*m, ...] (rank-major) -> [..., g*P*m, ...] (each block's slices in rank order).
    `zigzag`: each block is two halves, the second holding the ranks' slices in reverse."""
    parts, shape = stacked.shape[0], list(stacked.shape[1:])
    dim = dim % len(shape)
    groups = block_count(groups, shape[dim], parts, whole=False) * (2 if zigzag else 1)
    m = shape[dim] // groups
    x = stacked.reshape([parts] + shape[:dim] + [groups, m] + shape[dim + 1:])
    x = x.movedim(0, dim + 1)  # [..., g, P, m, ...]
    if zigzag:
        x = _reverse_second_halves(x, dim, groups)
    return x.reshape(shape[:dim] + [groups * parts * m] + shape[dim + 1:])


def _deinterleave(x: torch.Tensor, dim: int, groups: int, parts: int,
                  zigzag: bool = False) -> torch.Tensor:
    """[..., g*P*m, ...] -> [P, ..., g*m, ...]: rank r's slice of every block, stacked by rank."""
    shape = list(x.shape)
    dim = dim % len(shape)
    groups = block_count(groups, shape[dim], parts, whole=True) * (2 if zigzag else 1)
    m = shape[dim] // (groups * parts)
    y = x.reshape(shape[:dim] + [groups, parts, m] + shape[dim + 1:])
    if zigzag:
        y = _reverse_second_halves(y, dim, groups)
    y = y.movedim(dim + 1, 0)  # [P, ..., g, m, ...]
    return y.reshape([parts] + shape[:dim] + [groups * m] + shape[dim + 1:])


def _reverse_second_halves(x: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    """[..., g, P, m, ...] with g = 2 x blocks: the rank order of every odd half reversed."""
    x = x.unflatten(dim, (groups // 2, 2))  # [..., blocks, 2, P, m, ...]
    first, second = x.select(dim + 1, 0), x.select(dim + 1, 1).flip(dim + 1)
    return torch.stack([first, second], dim + 1).flatten(dim, dim + 1)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, dim: int, groups: int, zigzag: bool):
        ctx.g, ctx.dim, ctx.groups, ctx.zigzag = g, dim, groups, zigzag
        return g.local_slice(x, dim, groups, zigzag)

    @staticmethod
    def backward(ctx, grad):
        return ctx.g.all_gather(grad, ctx.dim, ctx.groups, "backward", ctx.zigzag), \
            None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, dim: int, groups: int, zigzag: bool):
        ctx.g, ctx.dim, ctx.groups, ctx.zigzag = g, dim, groups, zigzag
        return g.all_gather(x, dim, groups, "forward", zigzag)

    @staticmethod
    def backward(ctx, grad):
        return ctx.g.local_slice(grad, ctx.dim, ctx.groups, ctx.zigzag), None, None, None, None


class _GatherSumGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, dim: int, groups: int, zigzag: bool):
        ctx.g, ctx.dim, ctx.groups, ctx.zigzag = g, dim, groups, zigzag
        return g.all_gather(x, dim, groups, "forward", zigzag)

    @staticmethod
    def backward(ctx, grad):
        return ctx.g.reduce_scatter(grad, ctx.dim, ctx.groups, "backward", ctx.zigzag), \
            None, None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, dim, groups, zigzag):
        return g.all_reduce(x.clone(), "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, dim: int, groups: int, zigzag: bool):
        ctx.g, ctx.dim, ctx.groups, ctx.zigzag = g, dim, groups, zigzag
        return g.reduce_scatter(x, dim, groups, "forward", zigzag)

    @staticmethod
    def backward(ctx, grad):
        return ctx.g.all_gather(grad, ctx.dim, ctx.groups, "backward", ctx.zigzag), \
            None, None, None, None


class _SumGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, dim, groups, zigzag):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.g.all_reduce(grad.clone(), "backward"), None, None, None, None


def copy_to_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Megatron's f: x unchanged forward; its gradient all-reduced (summed) over g backward."""
    return _SumGrads.apply(x, g, None, 1, False)


def reduce_from_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Megatron's g: partial sums all-reduced over g forward; the gradient unchanged backward."""
    return _Reduce.apply(x, g, None, 1, False)


FUNCTIONS = {"split": _Split, "gather": _Gather, "gather_sum_grads": _GatherSumGrads,
             "reduce": _Reduce, "reduce_scatter": _ReduceScatter, "sum_grads": _SumGrads}


class Bound(nn.Module):
    """A graph module that needs a mesh axis; the runtime binds it before the graph runs."""

    def __init__(self, axis: str):
        super().__init__()
        self.axis = axis
        self.group: AxisGroup | None = None

    def bind(self, groups: dict[str, AxisGroup]) -> None:
        self.group = groups[self.axis]

    def _g(self) -> AxisGroup:
        if self.group is None:
            raise RuntimeError(f"{type(self).__name__} on axis '{self.axis}' runs before the "
                               "graph was bound to a mesh; call autopar.runtime.bind(gm, groups).")
        return self.group


class Redistribute(Bound):
    """One redistribution step as a node of the rewritten graph (see the module docstring)."""

    def __init__(self, kind: str, axis: str, dim: int | None = None, groups: int = 1,
                 zigzag: bool = False):
        super().__init__(axis)
        if kind not in FUNCTIONS:
            raise ValueError(f"unknown redistribution {kind!r}; expected one of {sorted(FUNCTIONS)}")
        self.kind, self.dim, self.groups, self.zigzag = kind, dim, groups, zigzag

    def extra_repr(self) -> str:
        dim = "" if self.dim is None else f", dim={self.dim}, groups={self.groups}"
        return f"{self.kind}, axis={self.axis}{dim}" + (", zigzag" if self.zigzag else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FUNCTIONS[self.kind].apply(x, self._g(), self.dim, self.groups, self.zigzag)


def bind(gm: nn.Module, groups: dict[str, AxisGroup]) -> None:
    """Give every collective of a rewritten graph its process group."""
    for module in gm.modules():
        if isinstance(module, Bound):
            module.bind(groups)
