"""ZeRO beside an expert axis: the experts' pieces are cut over their expert-data group (the
data ranks holding the same experts), every other parameter's over dp, and one optimizer
steps both sets of pieces. An expert gradient already sums the tokens of its ep group (the
all-to-all's backward), so the sum over edp, divided by dp = edp x ep / cp, is the mean (as
dp's mean of the rest, whose gradients the graph summed over cp, is). Under a
pipeline each part takes this rank's stages' parameters: stage 2 reduce-scatters each
stage's buckets of both parts per micro-batch, stage 3 gathers and reduces inside the
stages' graphs, and the pieces' sums over the micro-batches become their mean after the
schedule."""

from __future__ import annotations

import contextlib

from autopar.runtime.zero3 import ZeroThree
from autopar.runtime.zero_state import ZeroState


def expert_zero(family, plan_zero, params, dp, edp, divisor: float, is_expert, factory,
                compute_dtype, stages=None, pieces=None):
    """The ZeRO state of a plan's stage `family` (runtime.gradients.zero_family) with the
    experts (`is_expert`) cut over `edp`, their sums divided by edp x `divisor` (= dp;
    `Gradients.expert_divisor`) (`stages`: under a pipeline, each of this rank's stages'
    parameters, for ZeRO-2; `pieces`: ZeRO-3's pieces a start made, each part adopting its
    own)."""
    params = list(params)
    hybrid = getattr(dp, "divisor", 1)  # HSDP: the rest's sums span the dp_replicate replicas
    rest = [p for p in params if not is_expert(p)]
    experts = [p for p in params if is_expert(p)]
    if issubclass(family, ZeroThree):
        return ExpertDataZeroThree(
            ZeroThree(rest, dp, None, plan_zero.offload, compute_dtype, pieces=pieces,
                      divisor=hybrid),
            ZeroThree(experts, edp, None, plan_zero.offload, compute_dtype, divisor=divisor,
                      prefix="zero3_experts_gather", pieces=pieces), factory)
    extra = {"stages": stages} if family.reduces_in_backward else {}
    return ExpertDataZero(
        family(rest, dp, None, offload=plan_zero.offload, divisor=hybrid, **extra),
        family(experts, edp, None, offload=plan_zero.offload, divisor=divisor, **extra),
        factory)


class ExpertDataZero(ZeroState):
    """ZeRO-1/2: the dp part and the edp (experts) part, one optimizer."""

    def __init__(self, data, experts, factory):
        self._parts = (data, experts)
        self.stage, self.offload, self.dp = data.stage, data.offload, data.dp
        self.pieces_only, self.reduces_in_backward = data.pieces_only, data.reduces_in_backward
        self.params = data.params + experts.params
        self.shards = data.shards + experts.shards
        self.optimizer = factory(self.shards) if factory is not None else None

    @property
    def parts(self) -> tuple[ZeroState, ZeroState]:
        return self._parts

    def local_shape(self, param) -> tuple[int, ...] | None:
        return next((s for s in (part.local_shape(param) for part in self.parts)
                     if s is not None), None)

    def traffic(self, runs: int, units=()) -> tuple[int, int, int]:
        """The dp part's bytes (the experts' travel on the edp axis: `expert_traffic`)."""
        return self.parts[0].traffic(runs, units)

    def expert_units(self, graphs) -> list[int]:
        return []

    def expert_traffic(self, runs: int, graphs) -> tuple[int, int, int]:
        """The experts' bytes on the edp axis, as `traffic` (`graphs`: those this rank's
        step runs, for ZeRO-3's gathers)."""
        return self.parts[1].traffic(runs, self.expert_units(graphs))

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()

    def gather_parameters(self) -> None:
        for part in self.parts:
            part.gather_parameters()

    def microbatch_done(self) -> None:
        for part in self.parts:
            part.microbatch_done()

    def stage_done(self, j: int) -> None:
        """ZeRO-2 under a pipeline: this rank's j-th stage made one micro-batch's weight
        gradients; each part sends its buckets of that stage now complete."""
        for part in self.parts:
            part.stage_done(j)

    def wire_pipeline(self, runner) -> list[int]:
        if self.reduces_in_backward:
            runner.weights_done = self.stage_done
        return []

    def after_pipeline(self, microbatches: int, tied) -> None:
        """Under a pipeline: each part's pieces, the sums over the micro-batches, become
        their mean (a tied parameter is never an expert: the dp part sums it)."""
        for part in self.parts:
            part.after_pipeline(microbatches, tied if part is self.parts[0] else ())


class ExpertDataZeroThree(ExpertDataZero):
    """ZeRO-3: each part gathers its own parameters in the graphs, layer by layer (the
    units `rewrite` returns are the dp part's; `expert_units` the experts')."""

    wire_pipeline = ZeroThree.wire_pipeline  # (with this pair's rewrite and saving)

    def __init__(self, data: ZeroThree, experts: ZeroThree, factory):
        super().__init__(data, experts, factory)
        self.numels = data.numels + experts.numels
        self._expert_units: dict[int, list[int]] = {}  # id(graph) -> its experts' units

    @property
    def overlap(self) -> bool:
        """Whether the reduce-scatters land at `end_backward` (False under a pipeline: the
        pieces' gradients come out of autograd, per micro-batch)."""
        return self.parts[0].overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        for part in self.parts:
            part.overlap = value

    def index_of(self, param) -> int | None:
        data, experts = self.parts
        i = data.index_of(param)
        j = experts.index_of(param) if i is None else None
        return i if j is None else len(data.params) + j

    def rewrite(self, gm) -> list[int]:
        """The dp part's units, in graph order; the experts' are kept per graph
        (`expert_units`)."""
        order = self.parts[0].rewrite(gm)
        self._expert_units[id(gm)] = self.parts[1].rewrite(gm)
        return order

    def expert_units(self, graphs) -> list[int]:
        """The experts' units `graphs` gather (the training graph, or a pipeline rank's
        stages and loss), in order."""
        return [u for gm in graphs for u in self._expert_units.get(id(gm), ())]

    @contextlib.contextmanager
    def saving(self):
        with self.parts[0].saving(), self.parts[1].saving():
            yield

    def end_backward(self) -> None:
        for part in self.parts:
            part.end_backward()

    def drain(self) -> None:
        for part in self.parts:
            part.drain()

    def whole(self, param):
        data, experts = self.parts
        return (data if data.index_of(param) is not None else experts).whole(param)
