"""Test session setup: 8 simulated CPU devices, float32 matmuls, no network, no wandb."""

import os
import shutil
import tempfile

# One persistent compilation cache per test session, shared by the xdist workers (they inherit
# the controller's environment) and by the runs tests start as processes. The suite compiles
# the same small train steps many times over and XLA:CPU's compile is most of such a test's
# time (7 checkpoint-fault tests: 160 s without, 38 s with); a program loaded from the cache
# is the program that was compiled. The session that made the folder removes it.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lclm-tests-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# a size limit turns on JAX's file lock around every read and write of the cache: processes
# compiling the same program at once never read an entry another is still writing
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

from lclm.parallel.devices import request_cpu_devices  # noqa: E402  (sets XLA_FLAGS only)

request_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# libtpu (ahead-of-time TPU compiles, tests/test_aot.py) takes a machine-wide lock unless
# told otherwise. lclm.plan.aot says so itself where no TPU is attached; on a TPU VM too the test
# workers only compile (JAX_PLATFORMS=cpu), so parallel ones may each load it
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controller, or no xdist
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The files that hold slow tests first, each file's tests kept together (its fixtures are
    set up once per worker): with `-n 2` the long tests, most of them in tests/train/
    (collected last), would otherwise run alone at the end while the other worker idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


# the `gcs` and `s3` fixtures: local object-storage servers (tests/storage_servers.py)
pytest_plugins = ["storage_servers"]
