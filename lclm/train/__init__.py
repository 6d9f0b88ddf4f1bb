"""Training: state, step, loop, metrics."""
