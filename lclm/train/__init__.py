"""Training: the program (`program.py`: `python train.py`, `lclm-train`, `python -m
lclm.train`) and what it runs: the loop, step, stages and their gates, cadence, first
weights, faults, metrics. What a run's directory holds (checkpoints, state, resume rules,
locks) is `lclm.workdir`, below evaluation, which reads it; training stands above
evaluation, whose RULER scorer its stage gates call."""
