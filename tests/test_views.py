"""The report's views (autopar/plans/views.py): what Plan.explain, the planner and the engine
draw through, filled by autopar.report, which sits above them."""

import pytest

import autopar  # its import loads the report
from autopar.errors import AutoparError
from autopar.models import build
from autopar.plans import Plan, views
from autopar.report import measured, predicted


def test_the_report_fills_every_view_and_refuses_unknown_ones():
    """Plan.explain, the planner's detail and the engine's report draw through the views the
    report fills at import; a slot the layers below do not call is refused."""
    assert views.views().plan_text is predicted.plan_text
    with pytest.raises(AutoparError, match="no view slot named plan_html"):
        views.provide(plan_html=predicted.plan_text)


def test_plans_explain_themselves_through_the_report(tmp_path):
    """A searched plan explains its planner detail, and a plan read back from JSON (no
    detail) its own JSON, both drawn by the report's plan_text."""
    model, inputs = build("mlp-tiny", batch=4)
    plan = autopar.plan(model, inputs, autopar.World(devices=2, per_node=2, device="a100-80gb"),
                        global_batch=4)
    assert plan.detail is not None and plan.explain() == predicted.plan_text(plan.detail)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.explain() == predicted.plan_text(dict(loaded.to_json(), layer_kinds=[]))
    assert views.views().measured_text is measured.measured_text
