"""`python -m lclm.train`: the training program's launcher (`__main__.py`). The training
library it runs (loop, step, state, stages, checkpoints' faults, ...) is `lclm.training`."""
