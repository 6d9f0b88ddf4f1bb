"""Benchmarks: each prints a markdown table stamped with device, JAX version and date."""
