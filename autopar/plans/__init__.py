"""Plans as data: what the planner decides and the runtime executes (`schema`)."""

from autopar.plans.schema import LayerPlan, PipelinePlan, Plan, ZeroPlan, cp_layout

__all__ = ["LayerPlan", "PipelinePlan", "Plan", "ZeroPlan", "cp_layout"]
