"""plan pass: the plan as data (JSON round trip) and its explanation."""

from meshplan.plan.explain import explain, summary
from meshplan.plan.plan import Plan, load_plan, plan_from_json

__all__ = ["Plan", "explain", "load_plan", "plan_from_json", "summary"]
