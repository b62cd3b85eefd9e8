"""Plain data parallelism's gradient all-reduce in buckets, each sent as soon as its last
gradient is made, so it overlaps the backward (Li et al. 2020, PyTorch Distributed, §3.2.3)."""

from __future__ import annotations

import torch
from torch import nn

from autopar.kernels.collectives import AxisGroup

BUCKET_BYTES = 4 << 20


def average_gradients(params, dp: AxisGroup, divisor: float = 1) -> None:
    """After the backward, in one all-reduce over `dp`: each parameter's .grad becomes its
    mean over dp, also divided by `divisor` (a pipeline's micro-batch count). Parameters
    without a gradient are skipped."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dp.all_reduce(flat, "backward")
    flat /= dp.size * divisor
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()


class GradientBuckets:
    def __init__(self, params: list[nn.Parameter], dp: AxisGroup,
                 bucket_bytes: int | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.dp = dp
        cap = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets: list[list[int]] = []
        size = 0
        for i in reversed(range(len(self.params))):
            nbytes = self.params[i].numel() * self.params[i].element_size()
            if not self.buckets or size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._done = [0] * len(self.buckets)
        self._sent: set[int] = set()  # buckets sent since the last finish
        self._flying: list[tuple] = []  # (bucket, its all-reduce in flight)
        self.armed = False  # the engine's train_step backward only, not a user's own
        self._hooks = [p.register_post_accumulate_grad_hook(
            lambda param, b=bucket_of[i]: self._count(b)) for i, p in enumerate(self.params)]

    def _count(self, b: int) -> None:
        if not self.armed:
            return
        self._done[b] += 1
        if self._done[b] == len(self.buckets[b]):
            self._send(b)

    def _send(self, b: int) -> None:
        self._done[b] = 0
        self._sent.add(b)
        grads = [self.params[i].grad for i in self.buckets[b] if self.params[i].grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._flying.append((b, self.dp.all_reduce_async(flat, "backward")))

    def finish(self, divisor: int = 1) -> None:
        """After the backward: every gradient this rank holds becomes its mean over dp (and
        is divided by `divisor` too: a pipeline's micro-batch count)."""
        for b in range(len(self.buckets)):
            if b not in self._sent:  # some of its parameters got no gradient this time
                self._send(b)
        self._sent.clear()
        self.armed = False
        for b, pending in self._flying:
            flat = pending.wait()
            offset = 0
            for i in self.buckets[b]:
                grad = self.params[i].grad
                if grad is not None:  # the sum's mean, written back in one pass
                    torch.div(flat[offset:offset + grad.numel()].view_as(grad),
                              self.dp.size * divisor, out=grad)
                    offset += grad.numel()
        self._flying.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
