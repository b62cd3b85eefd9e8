"""Reports: the predicted plan (`predicted`), per-layer detail (`layers`), the HTML page
(`html`) and predicted beside measured (`measured`). Importing it fills the views that
`Plan.explain`, the planner and the engine draw through (autopar.plans.views)."""

from autopar.plans.views import provide
from autopar.report.measured import measured_report, measured_text, step_prediction
from autopar.report.predicted import plan_report, plan_text

provide(plan_report=plan_report, plan_text=plan_text, measured_report=measured_report,
        measured_text=measured_text, step_prediction=step_prediction)
