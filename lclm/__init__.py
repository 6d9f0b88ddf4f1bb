"""lclm: long-context LLaMA training in JAX (striped ring attention, blockwise transformer).

Importing `lclm` does not import JAX: `train.py` must be able to read the config and set
`XLA_FLAGS` (simulated CPU devices) before JAX starts.
"""

__version__ = "0.1.0"
