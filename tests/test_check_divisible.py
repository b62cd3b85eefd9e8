"""`engine.check_divisible` refuses only block widths that really do not split over the
tensor size. Solved in one process with a size-8 tp group that is never called."""

import pytest
import torch
from equivalence import build
from torch import nn

import autopar
from autopar.errors import PlanError
from autopar.kernels.collectives import AxisGroup
from autopar.runtime.engine import Engine
from autopar.runtime.mesh import axis_groups


def _engine(model, x, tp):
    groups = axis_groups({"dp": 1, "tp": 1})
    groups["tp"] = AxisGroup("tp", tp, 0, None, groups["tp"].log)
    return Engine(model, autopar.Plan(mesh={"tp": tp}, tp_mode="1d"), groups, (x,), None, None)


def test_llama_tp8_keeps_kv_projections_whole():
    """llama-tiny has 4 key/value heads (wk, wv: 32 output features) and 8 query heads: at
    tensor size 8 the key/value projections stay whole on purpose, and 32 divides by 8, so
    the plan is accepted (it was refused with '32 output features ... tensor size 8')."""
    model, (x,), _, _ = build("llama-tiny", 8)
    engine = _engine(model, x[:2], 8)
    layouts = engine.parameter_layouts()
    for b in (0, 1):
        for w in ("wk", "wv"):
            assert not layouts[f"blocks.{b}.attention.{w}.weight"].shards
        assert layouts[f"blocks.{b}.attention.wq.weight"].shards


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 12), nn.ReLU(),
                                                   nn.Linear(12, 16))])

    def forward(self, x):
        return self.blocks[0](x)


def test_width_that_does_not_divide_is_refused():
    torch.manual_seed(0)
    with pytest.raises(PlanError, match="12 output features, which do not split over tensor "
                                        "size 8"):
        _engine(_Blocks(), torch.randn(2, 16), 8)
