"""Redistribution plans: the steps that move a layout to another, their cost model, the planner."""
