"""Planning a run before spending a pod-day (`python -m lclm.plan`, the CLI: `__main__`).

- `memory`: the per-device memory model (`estimate`, `report`) and the ring's overlap
  condition, before anything is compiled;
- `aot`: ahead-of-time compilation of the train step for a TPU slice or GPUs described on
  this machine (no accelerator needed), XLA's memory analysis of it;
- `strategies`: the context-parallel strategies compared by bytes per link, exposed time
  and memory (each registered strategy prices itself: `Strategy.cost`).

All three read the one hardware table, `lclm.hardware`.
"""
