"""autopar: trace a PyTorch model, plan how to split it over devices, and run the plan."""

import autopar.report  # noqa: F401  (fills the views Plan.explain and the engine draw)
from autopar import optim
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


def __getattr__(name: str):
    # `parallelize` imports the runtime (torch's pipelining, dynamo and distributed
    # checkpoint: over a second of CPU), which planning offline never needs: it is
    # imported the first time it is asked for, then held here as an ordinary name
    if name == "parallelize":
        from autopar.api import parallelize

        globals()["parallelize"] = parallelize
        return parallelize
    raise AttributeError(f"module 'autopar' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"parallelize"})
