"""Test session setup: 8 simulated CPU devices, float32 matmuls, no network, no wandb."""

import os

from lclm.parallel.devices import request_cpu_devices  # noqa: E402  (sets XLA_FLAGS only)

request_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# libtpu (ahead-of-time TPU compiles, tests/test_aot.py) takes a machine-wide lock unless
# told otherwise. lclm.aot says so itself where no TPU is attached; on a TPU VM too the test
# workers only compile (JAX_PLATFORMS=cpu), so parallel ones may each load it
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
