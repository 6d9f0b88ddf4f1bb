"""Train a LLaMA, Qwen or Mistral model with striped ring attention.

    python train.py --config configs/demo.py   (or: lclm-train, python -m lclm.train)
    python train.py --config configs/demo.py --config.train.steps=10 --config.mesh.sp=4 \\
        --config.workdir=/tmp/run
    python train.py --config configs/demo.py --print-config   (the config a run gets; no run)

A config with `stages.list` (or `stages.schedule`) runs its stages one after another
(lclm.train.stages); the same command resumes an interrupted staged run. Any config field
can be overridden with --config.<path>=<value>; `--help` lists every field with its default.
When the mesh needs more devices than the machine has, they are simulated on the CPU. A bad
config or input stops the run at start with one line `error: ...` and exit status 2; a run
that stops itself (train.max_bad_steps non-finite steps in a row, checkpoints that cannot be
saved, a stage gate that fails) prints one line and exits with status 3.
"""

import sys

import jax

from lclm import logs
from lclm.cli import config_main
from lclm.config import mesh_device_count
from lclm.config.stages import stage_configs
from lclm.parallel import distributed
from lclm.parallel.devices import allow_gpu_host_memory, request_cpu_devices
from lclm.train.loop import train
from lclm.train.stages import check_stages, run_stages


def run(config) -> None:
    """Train `config`, or its stages one after another when it has a schedule."""
    # before JAX starts its backends (importing it does not): simulated CPU devices and the
    # GPU's pinned host memory (split between local processes), then the multi-process runtime
    # when a launcher started several
    local = distributed.local_process_count()
    stages = stage_configs(config)
    # the stage with the largest mesh decides how many CPU devices to simulate
    request_cpu_devices(max(mesh_device_count(c) or 1 for c in stages or [config]) // local)
    allow_gpu_host_memory(local)
    logs.configure()
    distributed.initialize()
    logs.configure(main_process=jax.process_index() == 0)
    run_stages(config) if stages else train(config)


def main(argv: list[str] | None = None) -> int:
    return config_main(
        sys.argv if argv is None else argv, "configs/demo.py", __doc__, run, check=check_stages
    )


if __name__ == "__main__":
    sys.exit(main())
