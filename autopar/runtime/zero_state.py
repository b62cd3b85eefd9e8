"""ZeRO behind one interface: what the engine, the gradient path, the pipeline, the
checkpoint and the accounting ask of a rank's ZeRO state, whichever stage it runs. The
families implement it (runtime.zero: `ZeroOne`, `ZeroTwo`; runtime.zero3: `ZeroThree`;
runtime.zero_experts: the pair beside an expert axis); runtime code asks these behaviours
and never compares stage numbers. The defaults are what a family that neither gathers in
the graphs nor reduces during the backward does: nothing."""

from __future__ import annotations

import abc
import contextlib

import torch
from torch import nn


class ZeroState(abc.ABC):
    """One rank's ZeRO state: `params` (the local parameters it cuts), `shards` (this rank's
    piece of each, what the optimizer steps) and `optimizer`."""

    stage: int  # the plan's number, for reports; behaviour is asked of the methods below
    pieces_only = False  # the pieces are all a rank keeps of each parameter (ZeRO-3)
    reduces_in_backward = False  # gradients reduced into the pieces as backwards make them
    params: list[nn.Parameter]
    shards: list[nn.Parameter]
    optimizer = None

    # ------------------------------------------------------------------ what it holds
    @property
    def parts(self) -> tuple[ZeroState, ...]:
        """The states that cut pieces, each over its own group (one; beside an expert axis
        the dp part and the experts' edp part)."""
        return (self,)

    def pieces(self) -> dict[int, tuple[torch.Tensor, int]]:
        """id(local parameter) -> (this rank's piece of it, the piece's first flat position
        in the parameter)."""
        out = {}
        for part in self.parts:
            r = part.dp.rank
            out.update({id(p): (s, r * k)
                        for p, s, k in zip(part.params, part.shards, part.chunks)})
        return out

    def owners(self) -> dict[int, nn.Parameter]:
        """id(piece) -> the local parameter it is a piece of."""
        return {id(s): p for s, p in zip(self.shards, self.params)}

    def local_shape(self, param) -> tuple[int, ...] | None:
        """The shape of a local parameter this state has emptied (None: it keeps it whole)."""
        return None

    def keeps_only_piece(self, param) -> bool:
        """Whether this rank keeps only its piece of `param` (made whole to read it)."""
        return self.local_shape(param) is not None

    # ------------------------------------------------------------------ gather, release
    def rewrite(self, gm) -> list[int]:
        """Make `gm` gather the parameters it reads (none: the parameters are whole);
        returns the units gathered, in graph order."""
        return []

    def wire_pipeline(self, runner) -> list[int]:
        """Hook into a pipeline's runner (this rank's stages); returns the units the stages
        gather."""
        return []

    def saving(self):
        """A context around a training forward (ZeRO-3: saved parameters are released)."""
        return contextlib.nullcontext()

    def drain(self) -> None:
        """After an inference forward: nothing left in flight."""
        return None  # the default: nothing to do

    # ------------------------------------------------------------------ reduce
    def microbatch_done(self) -> None:
        """Gradient accumulation: one micro-batch's backward is done (not the last)."""
        return None  # the default: nothing to do

    def end_backward(self) -> None:
        """The step's whole backward is done (every micro-batch's)."""
        return None  # the default: nothing to do

    def after_pipeline(self, microbatches: int, tied) -> None:
        """After a pipeline's schedule: pieces that summed the micro-batches' gradients
        become their mean (none here: the runner averages whole gradients)."""
        return None  # the default: nothing to do

    @abc.abstractmethod
    def reduce_gradients(self) -> None:
        """Sum (or reduce-scatter) the step's gradients into the pieces the optimizer steps."""

    @abc.abstractmethod
    def gather_parameters(self) -> None:
        """Bring every rank's updated pieces back into the local parameters."""

    # ------------------------------------------------------------------ bytes
    @abc.abstractmethod
    def traffic(self, runs: int, units=()) -> tuple[int, int, int]:
        """Bytes of one step's (reduce-scatters, all-gathers, fp8 amax all-reduces) on this
        state's group (`runs`: micro-batches; `units`: ZeRO-3's layers the graphs gather)."""

    def tied_bytes(self, param) -> int:
        """Bytes of a tied parameter's gradient as the pipeline members sum it: this rank's
        piece where the backward reduced it over dp first, else whole."""
        if not self.reduces_in_backward:
            return param.numel() * param.element_size()
        part = self.parts[0]  # (beside an expert axis: the dp part; a tie is no expert)
        shard = next(s for p, s in zip(part.params, part.shards) if p is param)
        return shard.numel() * shard.element_size()


def zero_parts(zero: ZeroState | None) -> tuple[ZeroState, ...]:
    """A state's parts (none without ZeRO)."""
    return () if zero is None else zero.parts
