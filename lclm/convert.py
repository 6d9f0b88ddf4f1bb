"""Convert between HuggingFace LLaMA directories and lclm checkpoints.

    python -m lclm.convert --from-hf HF_DIR --to-checkpoint WORKDIR
    python -m lclm.convert --from-checkpoint WORKDIR --to-hf HF_DIR

An lclm checkpoint lives in `WORKDIR/checkpoints/STEP` (what `train.py` writes and resumes
from). `--to-checkpoint` writes step 0 with a fresh optimizer state, so
`train.py --config.workdir=WORKDIR` fine-tunes from it; `--to-hf` exports the parameters of
the latest step in canonical layout, whatever mesh or layout the run used.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from lclm import hf
from lclm.checkpoint import Checkpoints
from lclm.config import base_config
from lclm.models.llama import LlamaConfig, init_params
from lclm.train.loop import public_config
from lclm.train.state import TrainState
from lclm.train.step import make_optimizer


def hf_to_checkpoint(hf_dir: str, workdir: str) -> int:
    model, params = hf.load(hf_dir)
    config = base_config()
    config.model.update({k: v for k, v in vars(model).items() if k in config.model})
    optimizer = make_optimizer(config.train)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    checkpoints = Checkpoints(workdir, every=0, keep=3)
    checkpoints.save(0, state, None, public_config(config))
    checkpoints.close()
    return 0


def checkpoint_to_hf(workdir: str, hf_dir: str) -> int:
    checkpoints = Checkpoints(workdir, every=0, keep=3)
    step = checkpoints.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir!r}/checkpoints")
    saved = checkpoints.manager.restore(step, args=_config_args())["config"]
    config = base_config()
    config.model.update(saved["model"])
    config.train.update(saved["train"])
    model = LlamaConfig.from_config(config.model)
    optimizer = make_optimizer(config.train)

    def fresh():
        params = init_params(model, jax.random.key(0))
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

    template = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fresh))
    state, _ = checkpoints.restore(template)
    checkpoints.close()
    hf.save(hf_dir, model, jax.device_get(state.params))
    return 0


def _config_args():
    import orbax.checkpoint as ocp
    return ocp.args.Composite(config=ocp.args.JsonRestore())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf")
    src.add_argument("--from-checkpoint")
    dst = ap.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-checkpoint")
    dst.add_argument("--to-hf")
    args = ap.parse_args(argv)
    try:
        if args.from_hf and args.to_checkpoint:
            return hf_to_checkpoint(args.from_hf, args.to_checkpoint)
        if args.from_checkpoint and args.to_hf:
            return checkpoint_to_hf(args.from_checkpoint, args.to_hf)
        ap.error("use --from-hf with --to-checkpoint, or --from-checkpoint with --to-hf")
    except (OSError, ValueError) as e:  # a missing, unreadable or malformed input: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
