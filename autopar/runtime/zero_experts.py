"""ZeRO beside an expert axis: the experts' pieces are cut over their expert-data group (the
data ranks holding the same experts), every other parameter's over dp, and one optimizer
steps both sets of pieces. An expert gradient already sums the tokens of its ep group (the
all-to-all's backward), so the sum over edp, divided by dp = edp x ep, is the mean."""

from __future__ import annotations

import contextlib

from autopar.runtime.zero import ShardedOptimizerState
from autopar.runtime.zero3 import ZeroThree


def expert_zero(plan_zero, params, dp, edp, ep: int, is_expert, factory, compute_dtype):
    """The ZeRO state of a plan's stage with the experts (`is_expert`) cut over `edp`."""
    params = list(params)
    rest = [p for p in params if not is_expert(p)]
    experts = [p for p in params if is_expert(p)]
    if plan_zero.stage == 3:
        return ExpertDataZeroThree(
            ZeroThree(rest, dp, None, plan_zero.offload, compute_dtype),
            ZeroThree(experts, edp, None, plan_zero.offload, compute_dtype, divisor=ep,
                      prefix="zero3_experts_gather"), factory)
    return ExpertDataZero(
        ShardedOptimizerState(rest, dp, None, plan_zero.stage, offload=plan_zero.offload),
        ShardedOptimizerState(experts, edp, None, plan_zero.stage, offload=plan_zero.offload,
                              divisor=ep), factory)


class ExpertDataZero:
    """ZeRO-1/2: the dp part and the edp (experts) part, one optimizer."""

    def __init__(self, data, experts, factory):
        self.parts = (data, experts)
        self.stage, self.offload, self.dp = data.stage, data.offload, data.dp
        self.params = data.params + experts.params
        self.shards = data.shards + experts.shards
        self.optimizer = factory(self.shards) if factory is not None else None

    def padded_bytes(self) -> int:
        """The dp pieces' bytes (the experts' travel on the edp axis)."""
        return self.parts[0].padded_bytes()

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()

    def gather_parameters(self) -> None:
        for part in self.parts:
            part.gather_parameters()


class ExpertDataZeroThree(ExpertDataZero):
    """ZeRO-3: each part gathers its own parameters in the graphs, layer by layer. The
    byte counts the accounting reads (units, gathers) are the dp part's."""

    def __init__(self, data: ZeroThree, experts: ZeroThree, factory):
        super().__init__(data, experts, factory)
        self.numels = data.numels + experts.numels
        self.expert_units: list[int] = []

    def index_of(self, param) -> int | None:
        data, experts = self.parts
        i = data.index_of(param)
        j = experts.index_of(param) if i is None else None
        return i if j is None else len(data.params) + j

    def rewrite(self, gm) -> list[int]:
        """The dp part's units, in graph order; the experts' are kept in `expert_units`
        (those of the last graph rewritten: the training graph's)."""
        order = self.parts[0].rewrite(gm)
        self.expert_units = self.parts[1].rewrite(gm)
        return order

    def unit_bytes(self, u: int) -> int:
        return self.parts[0].unit_bytes(u)

    def gather_bytes(self, u: int) -> int:
        return self.parts[0].gather_bytes(u)

    @property
    def backward_gathers(self):
        return self.parts[0].backward_gathers

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
