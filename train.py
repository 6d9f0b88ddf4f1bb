"""Train a LLaMA with striped ring attention.

    python train.py --config configs/demo.py
    python train.py --config configs/demo.py --config.train.steps=10 --config.mesh.sp=4 \
        --config.workdir=/tmp/run

A config with `stages.schedule` runs its stages one after another (lclm.train.stages); the
same command resumes an interrupted staged run. Any config field can be overridden with
--config.<path>=<value>. When the mesh needs more devices than the machine has, they are
simulated on the CPU. A bad config or input stops the run at start with one line
`error: ...` and exit status 2; a run that stops itself (train.max_bad_steps non-finite
steps in a row, checkpoints that cannot be saved) prints one line and exits with status 3.
"""

import sys


def run(config) -> None:
    """Train `config`, or its stages one after another when it has a schedule."""
    from lclm import logs
    from lclm.config import mesh_device_count
    from lclm.parallel import distributed
    from lclm.parallel.devices import request_cpu_devices

    # before JAX starts: simulated CPU devices (split between local processes), then the
    # multi-process runtime when a launcher started several processes
    request_cpu_devices((mesh_device_count(config) or 1) // distributed.local_process_count())
    logs.configure()
    distributed.initialize()
    import jax
    logs.configure(main_process=jax.process_index() == 0)
    from lclm.train.loop import train
    from lclm.train.stages import run_stages
    run_stages(config) if config.stages.schedule else train(config)


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv[1:]):
        print(__doc__)
        return 0
    from lclm.config import config_from_argv
    from lclm.errors import StartupError, TrainingHalted
    try:
        run(config_from_argv(argv, default="configs/demo.py"))
    except (StartupError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingHalted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
