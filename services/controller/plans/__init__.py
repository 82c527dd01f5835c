"""A plan's life: recorded, held and approved, paused, resumed, cancelled, rolled out tier by
tier by the planner, reverted."""
