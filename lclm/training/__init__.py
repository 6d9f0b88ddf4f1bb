"""Training: the loop, step, state, stages, cadence, first weights, faults, metrics, locks."""
