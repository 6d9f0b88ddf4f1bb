"""lclm: long-context LLaMA training in JAX (striped ring attention, blockwise transformer).

Importing `lclm` does not import JAX, nor choose its platforms: `train.py` must be able to read
the config and set `XLA_FLAGS` (simulated CPU devices) before JAX starts, and the CLIs choose
the platforms where JAX would start libtpu for nothing (lclm.platforms) before its backends
start.
"""

__version__ = "0.1.0"
