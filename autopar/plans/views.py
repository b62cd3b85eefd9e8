"""Where the report plugs in. `Plan.explain`, the planner's per-plan detail and the
engine's measured report are drawn by `autopar.report`, which sits above the planner and
the runtime it describes: the layers below call these slots and never import the report;
the report fills them when it is imported (importing autopar does so)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from autopar.errors import AutoparError


@dataclass
class Views:
    """The report's entry points, by what they draw."""

    plan_report: Callable | None = None  # (plan, chain) -> the planner's detail (a dict)
    plan_text: Callable | None = None  # (detail or plan JSON, top) -> text
    measured_report: Callable | None = None  # (engine, world) -> predicted beside measured
    measured_text: Callable | None = None  # (measured_report's dict) -> text
    step_prediction: Callable | None = None  # (engine, world) -> the plan's step, as run


_VIEWS = Views()


def provide(**drawn: Callable) -> None:
    """Fill slots of the views (the report calls it once, at import)."""
    known = {f.name for f in fields(Views)}
    unknown = sorted(set(drawn) - known)
    if unknown:
        raise AutoparError(f"no view slot named {', '.join(unknown)}; the slots are "
                           f"{', '.join(sorted(known))}.")
    for name, fn in drawn.items():
        setattr(_VIEWS, name, fn)


def views() -> Views:
    """The report's entry points; every slot filled."""
    empty = [f.name for f in fields(Views) if getattr(_VIEWS, f.name) is None]
    if empty:
        raise AutoparError(f"the report has not filled {', '.join(empty)}: import "
                           "autopar.report (importing autopar does).")
    return _VIEWS
