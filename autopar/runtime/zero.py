"""ZeRO stages 1 and 2 over the data-parallel axis: each replica keeps 1/dp of the
optimizer state (stage 1), and of the gradients (stage 2).

Rajbhandari et al. 2019 (ZeRO, §5.1 "P_os"): every data-parallel rank holds the whole
parameters and computes whole gradients, but updates only its shard of every parameter
with its optimizer, then the ranks all-gather the updated shards. The optimizer's state
(Adam's two moments) is built for the shards only, so it is 1/dp per rank.

Layout: each parameter is flattened, padded to a multiple of dp and cut into dp equal
pieces; rank r owns piece r of every parameter. One buffer holds, rank after rank, the
pieces of all parameters, so a step is one reduce-scatter of the gradients (each rank
receives the sum of its pieces) and one all-gather of the updated pieces: the bytes of
a data-parallel all-reduce, split in its two halves (Rajbhandari et al. §7.2.1).

Stage 2 (§5.2 "P_os+g") reduce-scatters each parameter's gradient as soon as autograd
has accumulated it (a post-accumulate-grad hook) and frees the whole gradient there, so
whole gradients never pile up: a rank holds its pieces and at most the gradients of the
op that backward is running. The bytes are stage 1's, sent during the backward.

The optimizer the user's factory builds runs on the shards (one `nn.Parameter` per
parameter, in the same order), so element-wise optimizers (SGD, Adam, AdamW, weight
decay) give exactly the unsharded update.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.runtime.collectives import AxisGroup


class ShardedOptimizerState:
    def __init__(self, params: list[nn.Parameter], dp: AxisGroup, factory, stage: int = 1):
        self.params = [p for p in params if p.requires_grad]
        self.dp, self.stage = dp, stage
        self.numels = [p.numel() for p in self.params]
        self.chunks = [-(-n // dp.size) for n in self.numels]
        self.total = sum(self.chunks)  # this rank's piece of every parameter, in elements
        r = dp.rank
        # this rank's piece of each parameter is a view of the parameter itself (the last
        # ranks' pieces stop at its end): the optimizer updates it in place, no copy kept
        self.lengths = [max(0, min(k, n - r * k)) for n, k in zip(self.numels, self.chunks)]
        self.shards = [nn.Parameter(p.data.view(-1)[r * k:r * k + length])
                       for p, k, length in zip(self.params, self.chunks, self.lengths)]
        self.optimizer = factory(self.shards) if factory is not None else None
        self._hooks = []
        if stage >= 2:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=i: self._reduce_one(i)))

    def _reduce_one(self, i: int) -> None:
        """Stage 2: this parameter's gradient is complete; keep only this rank's piece of
        its mean over dp (added to what earlier backwards left, as .grad accumulates)."""
        p = self.params[i]
        padded = self._padded_grad(i)
        p.grad = None
        piece = (self.dp.reduce_scatter(padded, 0, 1, "backward") / self.dp.size)[
            :self.lengths[i]]
        shard = self.shards[i]
        shard.grad = piece if shard.grad is None else shard.grad + piece

    def _padded_grad(self, i: int) -> torch.Tensor:
        """Parameter i's gradient, flat, zero-padded to dp equal pieces."""
        p, n, k = self.params[i], self.numels[i], self.chunks[i]
        padded = torch.zeros(self.dp.size * k, dtype=p.dtype, device=p.device)
        padded[:n] = p.grad.reshape(-1)
        return padded

    def padded_bytes(self) -> int:
        """Bytes of one step's reduce-scatter inputs (and of its all-gather output)."""
        if not self.params:
            return 0
        return self.dp.size * self.total * self.params[0].element_size()

    def reduce_gradients(self) -> None:
        """Sum the gradients over dp into each rank's pieces (the mean, as DDP gives), and
        free the whole gradients (stage 2 did this during the backward)."""
        if not self.params or self.stage >= 2:
            return
        p0 = self.params[0]
        buf = torch.zeros(self.dp.size, self.total, dtype=p0.dtype, device=p0.device)
        offset = 0
        for i, (p, k) in enumerate(zip(self.params, self.chunks)):
            if p.grad is not None:
                buf[:, offset:offset + k] = self._padded_grad(i).view(self.dp.size, k)
                p.grad = None
            offset += k
        mine = self.dp.reduce_scatter(buf.reshape(-1), 0, 1, "backward")
        mine /= self.dp.size
        offset = 0
        for shard, k, length in zip(self.shards, self.chunks, self.lengths):
            shard.grad = mine[offset:offset + length]
            offset += k

    def gather_parameters(self) -> None:
        """Every rank gets every rank's updated pieces, written into the whole parameters."""
        if not self.params:
            return
        p0 = self.params[0]
        local = torch.zeros(self.total, dtype=p0.dtype, device=p0.device)
        offset = 0
        for shard, k, length in zip(self.shards, self.chunks, self.lengths):
            local[offset:offset + length] = shard.detach()
            offset += k
        full = self.dp.all_gather(local, 0, 1, "step").view(self.dp.size, self.total)
        offset = 0
        with torch.no_grad():
            for p, n, k in zip(self.params, self.numels, self.chunks):
                p.copy_(full[:, offset:offset + k].reshape(-1)[:n].view_as(p))
                offset += k
        for shard in self.shards:
            shard.grad = None
