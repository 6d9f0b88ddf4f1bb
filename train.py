"""Train a LLaMA with striped ring attention.

    python train.py --config configs/demo.py
    python train.py --config configs/demo.py --config.train.steps=10 --config.mesh.sp=4 \
        --config.workdir=/tmp/run

A config with `stages.schedule` runs its stages one after another (lclm.train.stages); the
same command resumes an interrupted staged run. Any config field can be overridden with --config.<path>=<value>. When the mesh needs more
devices than the machine has, they are simulated on the CPU.
"""

import logging
import sys

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py",
                                          "Path to a config file with get_config().")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    from lclm.config import ConfigError, mesh_device_count
    from lclm.parallel import distributed
    from lclm.parallel.devices import request_cpu_devices

    # before JAX starts: simulated CPU devices (split between local processes), then the
    # multi-process runtime when a launcher started several processes
    request_cpu_devices((mesh_device_count(config) or 1) // distributed.local_process_count())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save chatter
    distributed.initialize()
    import jax
    if jax.process_index() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    from lclm.train.loop import train
    from lclm.train.stages import run_stages
    try:
        run_stages(config) if config.stages.schedule else train(config)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
