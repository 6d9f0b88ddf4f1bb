"""Start-up of JAX's multi-controller runtime (`jax.distributed`) from the launcher's env.

- `launch/local.sh`: LCLM_COORDINATOR (host:port), LCLM_NUM_PROCESSES, LCLM_PROCESS_ID;
  CPU collectives between processes on this machine.
- SLURM (`launch/slurm_gpu.sbatch`): `jax.distributed.initialize()` reads SLURM_* itself; with
  one process per node (LCLM_PROCS_PER_NODE=1) every local GPU is given to that process.
- Cloud TPU pods (`launch/tpu_pod.sh`): `jax.distributed.initialize()` reads the TPU metadata.

Call `initialize()` before any other JAX use. Only the first process logs and writes metrics.
"""

from __future__ import annotations

import logging
import os

from lclm.errors import ConfigError

log = logging.getLogger(__name__)


def launcher() -> str:
    """Which launcher started this process: 'local', 'slurm', 'tpu' or 'single'."""
    if os.environ.get("LCLM_COORDINATOR"):
        return "local"
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if os.environ.get("TPU_WORKER_HOSTNAMES") and "," in os.environ["TPU_WORKER_HOSTNAMES"]:
        return "tpu"
    return "single"


def local_process_count() -> int:
    """Processes that share this machine's simulated CPU devices (1 unless local.sh)."""
    return int(os.environ.get("LCLM_NUM_PROCESSES", "1")) if launcher() == "local" else 1


def initialize() -> str:
    """Join the multi-process runtime when launched as part of one; returns the launcher."""
    kind = launcher()
    if kind == "single":
        return kind
    import jax

    if kind == "local":
        address = os.environ["LCLM_COORDINATOR"]
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["LCLM_NUM_PROCESSES"]),
            process_id=int(os.environ["LCLM_PROCESS_ID"]),
            coordinator_bind_address=address if address.startswith("127.") else None,
        )
    elif kind == "slurm" and os.environ.get("LCLM_PROCS_PER_NODE") == "1":
        gpus = os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("LCLM_GPUS_PER_NODE", "1")
        jax.distributed.initialize(local_device_ids=list(range(int(gpus))))
    else:
        jax.distributed.initialize()
    log.info(
        "process %d of %d (%s launcher), %d local devices",
        jax.process_index(),
        jax.process_count(),
        kind,
        jax.local_device_count(),
    )
    return kind


def check_same_config(config_json: str) -> None:
    """Fail on every process when the processes were given different configs."""
    import hashlib

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(config_json.encode()).digest()[:8], np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    differing = [i for i, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise ConfigError(
            f"processes {differing} were started with a different config than "
            "process 0; launch every process with the same arguments"
        )


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process (a preemption signal may reach only some)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
