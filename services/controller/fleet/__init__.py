"""The fleet as the holder hears it (machines, their reports, their budgets), the
declarations it publishes to them, and machines joining."""
