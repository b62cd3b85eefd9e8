"""ZeRO stages 1 and 2 over dp (Rajbhandari et al. 2019, §5.1-5.2): each rank steps its 1/dp
piece of every parameter (a reduce-scatter of the gradients, an all-gather of the pieces;
`ZeroTwo` reduce-scatters in buckets during the backward), optionally on the host
(ZeRO-Offload, Ren et al. 2021, §4). Both behind runtime.zero_state's interface."""

from __future__ import annotations

import torch
from torch import nn

from autopar.kernels.collectives import AxisGroup, Pending
from autopar.runtime.zero_state import ZeroState

BUCKET_BYTES = 4 << 20  # ZeRO-2: gradients reduce-scattered together (padded bytes)


class ZeroOne(ZeroState):
    """ZeRO-1: whole gradients through the backward, reduce-scattered at the step."""

    stage = 1

    def __init__(self, params: list[nn.Parameter], dp: AxisGroup, factory,
                 offload: bool = False, divisor: float = 1):
        self.params = [p for p in params if p.requires_grad]
        self.dp = dp
        self.divisor = divisor  # the mean is the sum over dp / (dp.size * divisor)
        self.numels = [p.numel() for p in self.params]
        self.chunks = [-(-n // dp.size) for n in self.numels]
        self.total = sum(self.chunks)  # this rank's piece of every parameter, in elements
        r = dp.rank
        # this rank's piece of each parameter is a view of the parameter itself (the last
        # ranks' pieces stop at its end): the optimizer updates it in place, no copy kept
        self.lengths = [max(0, min(k, n - r * k)) for n, k in zip(self.numels, self.chunks)]
        self.shards = [nn.Parameter(p.data.view(-1)[r * k:r * k + length])
                       for p, k, length in zip(self.params, self.chunks, self.lengths)]
        self.offload = offload
        if offload:  # the optimizer's pieces: copies on the host
            self.shards = [nn.Parameter(host_copy(s.detach())) for s in self.shards]
        self.optimizer = factory(self.shards) if factory is not None else None
        self.buckets: list[list[int]] = []  # ZeRO-2: parameter indices, reduced together

    def padded_bytes(self) -> int:
        """Bytes of one step's reduce-scatter inputs (and of its all-gather output)."""
        if not self.params:
            return 0
        return self.dp.size * self.total * self.params[0].element_size()

    def traffic(self, runs: int, units=()) -> tuple[int, int, int]:
        """One reduce-scatter and one all-gather of the padded pieces a step."""
        return self.padded_bytes(), self.padded_bytes(), 0

    def _to_shard(self, piece: torch.Tensor) -> torch.Tensor:
        """A gradient piece where its shard lives (down to the host under offload)."""
        return host_copy(piece) if self.offload else piece

    def reduce_gradients(self) -> None:
        """Sum the gradients over dp into each rank's pieces (the mean, as DDP gives), and
        free the whole gradients."""
        if not self.params:
            return
        p0 = self.params[0]
        buf = torch.zeros(self.dp.size, self.total, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p, k in zip(self.params, self.chunks):
            if p.grad is not None:
                write_padded(buf[:, offset:offset + k], p.grad)
                p.grad = None
            offset += k
        # (one data-parallel rank: offload alone, no collective)
        mine = self.dp.reduce_scatter(buf.reshape(-1), 0, 1, "backward") \
            if self.dp.size > 1 else buf.reshape(-1)
        mine /= self.dp.size * self.divisor
        offset = 0
        for shard, k, length in zip(self.shards, self.chunks, self.lengths):
            shard.grad = self._to_shard(mine[offset:offset + length])
            offset += k

    def gather_parameters(self) -> None:
        """Every rank gets every rank's updated pieces, written into the whole parameters."""
        if not self.params:
            return
        p0 = self.params[0]
        local = torch.zeros(self.total, dtype=p0.dtype, device=p0.device)
        offset = 0
        for shard, k, length in zip(self.shards, self.chunks, self.lengths):
            local[offset:offset + length] = shard.detach()  # (up from the host: offload)
            offset += k
        full = (self.dp.all_gather(local, 0, 1, "step") if self.dp.size > 1 else local).view(
            self.dp.size, self.total)
        offset = 0
        with torch.no_grad():
            for p, n, k in zip(self.params, self.numels, self.chunks):
                p.copy_(full[:, offset:offset + k].reshape(-1)[:n].view_as(p))
                offset += k
        for shard in self.shards:
            shard.grad = None


class ZeroTwo(ZeroOne):
    """ZeRO-2: gradients reduce-scattered in buckets as the backward makes them (under a
    pipeline, per stage and micro-batch; under accumulation, per micro-batch)."""

    stage = 2
    reduces_in_backward = True

    def __init__(self, params: list[nn.Parameter], dp: AxisGroup, factory,
                 offload: bool = False, divisor: float = 1, bucket_bytes: int | None = None,
                 stages: list[list[nn.Parameter]] | None = None):
        super().__init__(params, dp, factory, offload=offload, divisor=divisor)
        self._hooks = []
        self._reducing: list[tuple] = []  # buckets in flight
        self._make_buckets(BUCKET_BYTES if bucket_bytes is None else bucket_bytes, stages)

    def _make_buckets(self, bucket_bytes: int, stages) -> None:
        """Buckets of consecutive parameters (last first) up to `bucket_bytes`, each sent
        once all its gradients are made; under a pipeline one stage's parameters per bucket,
        sent at `stage_done` (a parameter two stages share is a bucket of its own)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [[index[id(p)] for p in ps if id(p) in index] for ps in stages] \
            if stages is not None else [list(range(len(self.params)))]
        reads = [sum(i in g for g in groups) for i in range(len(self.params))]
        size = self.params[0].element_size() * self.dp.size if self.params else 4
        self._need: list[int] = []
        self._stage_buckets: list[list[int]] = [[] for _ in groups]
        alone: dict[int, int] = {}  # a parameter read by two stages -> its bucket
        for g in reversed(range(len(groups))):
            fresh = True
            for i in reversed(groups[g]):
                if reads[i] > 1:
                    if i not in alone:
                        alone[i] = len(self.buckets)
                        self.buckets.append([i])
                        self._need.append(reads[i])
                    self._stage_buckets[g].append(alone[i])
                    fresh = True
                    continue
                if fresh or (sum(self.chunks[j] for j in self.buckets[-1]) + self.chunks[i]) \
                        * size > bucket_bytes:
                    self.buckets.append([])
                    self._need.append(1 if stages is not None else 0)
                    self._stage_buckets[g].append(len(self.buckets) - 1)
                    fresh = False
                self.buckets[-1].append(i)
                if stages is None:
                    self._need[-1] += 1
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._done = [0] * len(self.buckets)
        if stages is None:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=i: self._count(self._bucket_of[i])))

    def _count(self, b: int) -> None:
        self._done[b] += 1
        if self._done[b] == self._need[b]:
            self._reduce_bucket(b)

    def stage_done(self, j: int) -> None:
        """Under a pipeline: this rank's j-th stage has finished one micro-batch's weight
        gradients; send its buckets that are now complete."""
        for b in self._stage_buckets[j]:
            self._count(b)

    def wire_pipeline(self, runner) -> list[int]:
        """The runner says when a stage's weight gradients are made (`stage_done`)."""
        runner.weights_done = self.stage_done
        return []

    def microbatch_done(self) -> None:
        """This micro-batch's pieces, landed (the next backward adds to them)."""
        self.reduce_gradients()

    def after_pipeline(self, microbatches: int, tied) -> None:
        """Under a pipeline: the pieces hold the sum of the micro-batches' gradients (each
        reduce-scattered as its backward made them)."""
        self._land_reduced()
        pieces_after_pipeline(self, microbatches, tied)

    def traffic(self, runs: int, units=()) -> tuple[int, int, int]:
        """A reduce-scatter per micro-batch, one all-gather a step."""
        return runs * self.padded_bytes(), self.padded_bytes(), 0

    def _reduce_bucket(self, b: int) -> None:
        """Keep only this rank's piece of the mean over dp of each gradient of bucket b
        (added to what earlier backwards left, as .grad accumulates); free the rest."""
        members = self.buckets[b]
        self._done[b] = 0
        p0 = self.params[members[0]]
        width = sum(self.chunks[i] for i in members)
        buf = torch.zeros(self.dp.size, width, dtype=p0.dtype, device=p0.device)
        col = 0
        for i in members:
            k = self.chunks[i]
            if self.params[i].grad is not None:
                write_padded(buf[:, col:col + k], self.params[i].grad)
                self.params[i].grad = None
            col += k
        if self.dp.size > 1:  # sent while the backward goes on; landed by _land_reduced
            self._reducing.append((members, self.dp.reduce_scatter_async(buf.reshape(-1),
                                                                         "backward")))
        else:
            self._reducing.append((members, Pending(buf.reshape(-1), [])))

    def _land_reduced(self) -> None:
        """Wait for the buckets' reduce-scatters; add each piece of the mean over dp to its
        shard's gradient (as .grad accumulates)."""
        for members, pending in self._reducing:
            mine = pending.wait()
            mine /= self.dp.size * self.divisor
            col = 0
            for i in members:
                piece, shard = self._to_shard(mine[col:col + self.lengths[i]]), self.shards[i]
                shard.grad = piece if shard.grad is None else shard.grad + piece
                col += self.chunks[i]
        self._reducing.clear()

    def reduce_gradients(self) -> None:
        """Land the buckets in flight, sending first those some of whose parameters got no
        gradient this time; the whole gradients were freed during the backward."""
        if not self.params:
            return
        for b, done in enumerate(self._done):
            if done:
                self._reduce_bucket(b)
        self._land_reduced()


def write_padded(dst: torch.Tensor, grad: torch.Tensor, zero_padding: bool = False) -> None:
    """Write a gradient, flattened, into `dst` ([dp, k] columns: row r is rank r's piece).
    The last piece's tail is the padding: left as it is (a zeroed buffer's zeros), or
    zeroed here with `zero_padding` (a buffer not zeroed whole first)."""
    flat, (rows, k) = grad.reshape(-1), dst.shape
    full = flat.numel() // k
    dst[:full].copy_(flat[:full * k].view(full, k))
    if full < rows:
        tail = flat.numel() - full * k
        if tail:
            dst[full, :tail].copy_(flat[full * k:])
        if zero_padding:
            dst[full, tail:].zero_()
            dst[full + 1:].zero_()


def read_padded(dst: torch.Tensor, pieces: torch.Tensor) -> None:
    """The inverse of `write_padded`: one parameter's gathered `pieces` ([dp, k], the last
    rows' tails padding) into `dst` (its values, flat), one copy per part (no flattened
    intermediate: a reshape of strided columns copies once more)."""
    n, k = dst.numel(), pieces.shape[1]
    full = n // k
    dst[:full * k].view(full, k).copy_(pieces[:full])
    if n > full * k:
        dst[full * k:].copy_(pieces[full, :n - full * k])


def pieces_after_pipeline(zero, microbatches: int, tied) -> None:
    """ZeRO-2/3 under a pipeline: make the pieces' gradients (the sum over micro-batches)
    their mean, and sum a tied parameter's pieces over the pipeline members that hold it
    (`tied`: (parameter, its AxisGroup)), as the runner does for whole gradients."""
    for shard in zero.shards:
        if shard.grad is not None:
            shard.grad.div_(microbatches)
    where = {id(p): i for i, p in enumerate(zero.params)}
    for param, tie in tied:
        shard = zero.shards[where[id(param)]]
        if shard.grad is not None:
            shard.grad = tie.all_reduce(shard.grad, "step")


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory (pinned when `t` is on a GPU, so copies overlap)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                      pin_memory=t.device.type == "cuda")
    out.copy_(t)
    return out
