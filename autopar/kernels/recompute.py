"""Activation recomputation at run time: a region of a rewritten graph (one layer, or its
attention core) whose forward keeps only its inputs for the backward and runs again, once,
when the backward first needs what it saved (Chen et al. 2016; Korthikanti et al. 2022).

Like torch.utils.checkpoint (non-reentrant) it swaps the region's saved tensors for handles
through `saved_tensors_hooks`, but it recomputes once per forward call whatever the number of
backward passes that read them: a zero-bubble schedule differentiates inputs and weights in
two passes, and each would recompute (and replay the region's collectives) under torch's.
The region's inputs are saved through an autograd Function, so the hooks outside the region
see them as saved: the engine's recorder counts them as the layer's activations, and ZeRO-3
turns a gathered parameter into a gather again in the backward (the gather the plan prices
for the backward serves the recomputation too)."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from autopar.kernels.modules import StreamCall, StreamDropout

_STATE = threading.local()


def replaying() -> bool:
    """Whether a recomputation runs now (a kernel that counts its forwards skips these)."""
    return getattr(_STATE, "depth", 0) > 0


class _SaveInputs(torch.autograd.Function):
    """Holds the region's input tensors as saved tensors of a node no gradient reaches."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.empty((0,), device=dummy.device)

    @staticmethod
    def backward(ctx, grad):  # never reached: its output feeds nothing
        return (None,) * (1 + len(ctx.saved_tensors))


class _Holder:
    """What the region's forward saves in place of a tensor: its index in the region's
    saves; the recomputed value is dropped when autograd drops the holder."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: _Frame, index: int):
        self.frame, self.index = frame, index

    def __del__(self):
        values = self.frame.values
        if values is not None and self.index < len(values):
            values[self.index] = None


class _Frame:
    """One forward call of a region: how to run it again and what it saved."""

    def __init__(self, fn, args: tuple, streams: list[torch.Generator]):
        self.fn = fn
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.grads = [args[i].requires_grad for i in self.positions]
        self.others = list(args)  # the non-tensor arguments, as given
        # the parameters go in again as themselves: a compiled region guards on its inputs'
        # types, and a parameter saved (and unpacked) is a plain tensor, which would compile
        # the region again, saving its tensors in another order
        self.parameters = {i: args[i] for i in self.positions
                           if isinstance(args[i], nn.Parameter)}
        for i in self.positions:
            self.others[i] = None
        dummy = torch.empty((0,), requires_grad=True)
        self.saver = _SaveInputs.apply(dummy, *[args[i] for i in self.positions])
        self.cpu_rng = torch.get_rng_state()
        self.cuda = next((args[i].device for i in self.positions
                          if args[i].device.type == "cuda"), None)
        self.cuda_rng = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        self.streams = [(g, g.get_state()) for g in streams]
        self.count = 0  # tensors the forward saved
        self.shapes: list[tuple] = []
        self.values: list | None = None

    def pack(self, t: torch.Tensor) -> _Holder:
        self.shapes.append((tuple(t.shape), t.dtype))
        self.count += 1
        return _Holder(self, self.count - 1)

    def unpack(self, holder: _Holder) -> torch.Tensor:
        if self.values is None:
            self._recompute()
        return self.values[holder.index]

    def _recompute(self) -> None:
        saved = self.saver.grad_fn.saved_tensors  # (ZeRO-3: gathered again here)
        self.saver = None
        args = list(self.others)
        for i, t, grad in zip(self.positions, saved, self.grads):
            args[i] = t.detach().requires_grad_(grad) if grad else t.detach()
        for i, p in self.parameters.items():
            args[i] = p
        values: list[torch.Tensor] = []
        devices = [self.cuda] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices), _streams_at(self.streams), \
                torch.autograd.graph.saved_tensors_hooks(_keep(values), lambda t: t), \
                torch.enable_grad():
            torch.set_rng_state(self.cpu_rng)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.cuda)
            _STATE.depth = getattr(_STATE, "depth", 0) + 1
            try:
                self.fn(*args)
            finally:
                _STATE.depth -= 1
        got = [(tuple(t.shape), t.dtype) for t in values]
        if got != self.shapes:
            raise RuntimeError(f"a recomputed region saved {len(got)} tensors where its forward "
                               f"saved {len(self.shapes)} (or of other shapes): the region does "
                               "not run the same way twice; run it without recompute.")
        self.values = values
        self.fn = None


def _keep(values: list):
    def pack(t: torch.Tensor) -> torch.Tensor:
        values.append(t)
        return t

    return pack


@contextlib.contextmanager
def _streams_at(streams: list[tuple[torch.Generator, torch.Tensor]]):
    """Run with each dropout stream where it was at the forward, then put it back."""
    now = [g.get_state() for g, _ in streams]
    for g, state in streams:
        g.set_state(state)
    try:
        yield
    finally:
        for (g, _), state in zip(streams, now):
            g.set_state(state)


class Recomputed(nn.Module):
    """A graph node: `inner` (a region of a rewritten graph) run so that it keeps only its
    inputs for the backward and runs again when the backward needs its saved tensors."""

    def __init__(self, inner: nn.Module, layer: str, mode: str):
        super().__init__()
        self.inner, self.layer, self.mode = inner, layer, mode

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}, {self.mode}"

    def _streams(self) -> list[torch.Generator]:
        out = []
        for m in self.inner.modules():
            if isinstance(m, (StreamDropout, StreamCall)) and m.streams is not None:
                g = m.streams.get(m.stream)
                if all(g is not o for o in out):
                    out.append(g)
        return out

    def forward(self, *args):
        if not torch.is_grad_enabled():  # inference, or a shape probe: nothing is saved
            return self.inner(*args)
        frame = _Frame(self.inner, args, self._streams())
        with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
            return self.inner(*args)
