"""autopar: trace a PyTorch model, plan how to split it over devices, and run the plan."""

import autopar.report  # noqa: F401  (fills the views Plan.explain and the engine draw)
from autopar import optim
from autopar.api import parallelize
from autopar.errors import (
    AutoparError,
    BatchError,
    PlanError,
    RankStoppedError,
    TokenIdError,
    TraceError,
    WorldError,
)
from autopar.graph import trace
from autopar.plans import Plan
from autopar.search.planner import plan
from autopar.world import World

__all__ = ["AutoparError", "BatchError", "Plan", "PlanError", "RankStoppedError", "TokenIdError",
           "TraceError", "World", "WorldError", "optim", "parallelize", "plan", "trace"]
__version__ = "0.1.0"
