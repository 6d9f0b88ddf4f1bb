"""Convert between HuggingFace LLaMA directories and lclm checkpoints.

    python -m lclm.convert --from-hf HF_DIR --to-checkpoint WORKDIR
    python -m lclm.convert --from-checkpoint WORKDIR --to-hf HF_DIR

An lclm checkpoint lives in `WORKDIR/checkpoints/STEP` (what `train.py` writes and resumes
from). `--to-checkpoint` writes step 0 with a fresh optimizer state, so
`train.py --config.workdir=WORKDIR` fine-tunes from it; `--to-hf` exports the parameters of
the latest step in canonical layout, whatever mesh or layout the run used (a staged run's
WORKDIR exports its last stage with a checkpoint). Only the parameters are read. The export's
config.json states what was trained: the source's token ids, the RoPE theta and scaling
trained with (as transformers 4 and 5 read them) and max_position_embeddings = max(the
source's, the longest data.seq_len trained); the tokenizer (`data.tokenizer`, or
`--tokenizer PATH`) is exported beside it so that `AutoTokenizer.from_pretrained` loads it.
Files are written 0o644 (directories 0o755) whatever the umask; each is listed as written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from lclm import hf, logs
from lclm.checkpoint import Checkpoints, path_problem, read_config, read_params
from lclm.cli import run_cli
from lclm.config import LlamaConfig, base_config
from lclm.config.secrets import public_config
from lclm.data.tokenizer import Tokenizer
from lclm.errors import StartupError
from lclm.files import output_problem
from lclm.models.llama import param_count, param_shapes
from lclm.parallel import make_mesh
from lclm.train.lock import WorkdirLock
from lclm.train.resume import CONVERTED_FROM, tokenizer_fingerprint
from lclm.train.state import TrainState, param_shardings, state_shardings
from lclm.train.step import make_optimizer
from lclm.train.workdirs import (
    checkpointed_stages,
    object_store_problem,
    saved_steps,
    stage_dirs,
    workdir_to_read,
)


def _local_mesh():
    """This machine's devices as one fsdp axis: the model spread over all of them, whole on
    none (a conversion is one process)."""
    return make_mesh(fsdp=-1, devices=jax.local_devices())


def _converted_tokenizer(hf_dir: str) -> tuple[str, str | None]:
    """(the tokenizer of `hf_dir` that an export of the checkpoint copies back, or "" where
    it holds none; its fingerprint, which a run from the checkpoint compares its own with)."""
    for name in ("tokenizer.model", "tokenizer.json"):
        if os.path.isfile(os.path.join(hf_dir, name)):
            path = os.path.abspath(hf_dir if name == "tokenizer.json" else
                                   os.path.join(hf_dir, name))
            try:
                return path, tokenizer_fingerprint(Tokenizer(path))
            except (OSError, ValueError) as e:   # the weights still convert; say what is lost
                print(f"warning: {e}; a run from this checkpoint cannot be checked to use the "
                      "same tokenizer", file=sys.stderr)
                return path, None
    return "", None


def _check_checkpoint_target(workdir: str) -> None:
    """Refuse, before anything is read or written, a `--to-checkpoint` directory that cannot
    take a converted step 0 as a run's only checkpoint."""
    problem = output_problem(workdir) or path_problem(os.path.abspath(workdir))
    if problem:
        raise StartupError(f"--to-checkpoint {workdir!r} {problem}")
    stages = stage_dirs(workdir)
    if stages:   # the stages train and export from their own directories, not from step 0
        raise StartupError(
            f"--to-checkpoint {workdir!r} is a staged run's directory (it holds "
            f"{', '.join(os.path.basename(s) for s in stages)}), whose stages are runs of "
            "their own that never read a step 0 beside them; convert into a new directory")
    steps = saved_steps(workdir)
    if steps:
        _refuse_held(workdir, steps[-1])


def _refuse_held(workdir: str, step: int) -> None:
    # step 0 beside a run's: retention would delete older steps, training would resume them
    raise StartupError(f"--to-checkpoint {workdir!r} already holds a run's checkpoints (latest "
                       f"step {step}); convert into a new directory")


def hf_to_checkpoint(hf_dir: str, workdir: str) -> int:
    """Write the weights of HuggingFace directory `hf_dir` as step 0 of a run in `workdir`,
    with a fresh optimizer state. The saved config records the conversion (`identity`: the
    source and the fingerprint of its tokenizer), so that a run with its own config trains
    from it (lclm.train.resume compares only what the weights fix)."""
    _check_checkpoint_target(workdir)
    config = base_config()
    lock = None
    if os.path.isdir(workdir):   # a live run there refuses the conversion before any reading
        lock = WorkdirLock(workdir, config.workdir_lease_minutes)
        lock.acquire()
    try:
        optimizer = make_optimizer(config.train)
        model = hf.read_config(hf_dir)
        where = state_shardings(model, optimizer, _local_mesh())
        # before the workdir is made: a directory it refuses leaves no workdir behind; each
        # device reads its block
        model, params = hf.load(hf_dir, shardings=where.params)
        config.model.update({k: v for k, v in vars(model).items() if k in config.model})
        config.data.tokenizer, fingerprint = _converted_tokenizer(hf_dir)
        identity = {CONVERTED_FROM: os.path.abspath(hf_dir)}
        if fingerprint:
            identity["tokenizer"] = fingerprint
        opt_state = jax.jit(optimizer.init, out_shardings=where.opt_state)(params)
        state = TrainState(jnp.zeros((), jnp.int32), params, opt_state)
        if lock is None:
            os.makedirs(workdir, exist_ok=True)
            lock = WorkdirLock(workdir, config.workdir_lease_minutes)  # as training does
            lock.acquire()
        checkpoints = Checkpoints(workdir, every=0, keep=3)
        try:
            held = checkpoints.latest_step()
            if held is not None:   # saved while the weights were read
                _refuse_held(workdir, held)
            checkpoints.save(0, state, None, dict(public_config(config), identity=identity))
        finally:
            checkpoints.close()
    finally:
        if lock is not None:
            lock.release()
    print(f"converted {hf_dir} to {checkpoints.directory} step 0 "
          f"({param_count(model):,} parameters)")
    return 0


def _dataclass_fields(cls, values: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def checkpoint_to_hf(workdir: str, hf_dir: str, tokenizer: str | None = None) -> int:
    """Export the latest parameters of `workdir` (or, for a staged run's workdir, of its last
    stage with a checkpoint) to `hf_dir`: weights, a config.json that states what was trained
    (the source's token ids, the RoPE theta and scaling trained with, max positions covering
    the longest sequence trained) and the tokenizer. Only the parameters are read."""
    problem = output_problem(hf_dir)
    if problem:
        raise StartupError(f"--to-hf {hf_dir!r} {problem}")
    read = workdir_to_read(workdir, "--from-checkpoint")
    stages = checkpointed_stages(workdir) if read != workdir else []
    seq_lens = []
    for stage in stages:  # every stage up to the exported one trained its sequence length
        seq_lens.append(read_config(stage)[1].get("data", {}).get("seq_len", 0))
    if stages:
        print(f"{workdir}: staged run; exporting its last stage with a checkpoint, "
              f"{os.path.basename(read)}")
        workdir = read
    step, saved = read_config(workdir)
    model = LlamaConfig(**_dataclass_fields(LlamaConfig, saved["model"]))
    # step 0 (`--to-checkpoint`'s) has trained nothing: only the source's positions count
    trained = max([saved.get("data", {}).get("seq_len", 0) if step else 0, *seq_lens])
    model = dataclasses.replace(
        model, max_position_embeddings=max(model.max_position_embeddings, trained))
    # spread over this machine's devices; the export gathers one layer at a time to the host
    abstract = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape, jnp.dtype(model.param_dtype),
                                                     sharding=sharding),
        param_shapes(model), param_shardings(model, _local_mesh()),
        is_leaf=lambda x: isinstance(x, tuple))
    written = hf.save(hf_dir, model, read_params(workdir, step, abstract))
    tokenizer = tokenizer or saved.get("data", {}).get("tokenizer", "")
    notes: list[str] = []
    if tokenizer:
        try:
            files, notes = hf.save_tokenizer(tokenizer, hf_dir, model)
            written += files
        except (OSError, ValueError) as e:  # the weights are out; say what is missing
            notes.append(f"{e}; no tokenizer exported (pass --tokenizer PATH)")
    else:
        notes.append("the checkpoint's config names no tokenizer; none exported (pass "
                     "--tokenizer PATH)")
    stale = [name for name in hf.TOKENIZER_FILES
             if name not in written and os.path.exists(os.path.join(hf_dir, name))]
    if stale:
        notes.append(f"{hf_dir} also holds {', '.join(stale)}, not written by this export")
    _report(workdir, step, hf_dir, model, trained, tokenizer, written, notes)
    return 0


def _report(workdir, step, hf_dir, model, trained, tokenizer, written, notes) -> None:
    """What the export wrote: one line per file, the config's highlights, the warnings."""
    rope = f"rope_theta {model.rope_theta:g}"
    if model.rope_scaling != "none":
        rope += f", {model.rope_scaling} scaling x{model.rope_factor:g}"
        if model.rope_scaling == "llama3":
            rope += (f" (low/high freq factors {model.rope_low_freq_factor:g}/"
                     f"{model.rope_high_freq_factor:g}, original max positions "
                     f"{model.rope_original_max_positions})")
    print(f"exported {workdir} step {step} to {hf_dir}:")
    for name in written:
        path = os.path.join(hf_dir, name)
        what = ""
        if name == "config.json":
            what = (f"{model.n_layers} layers, dim {model.dim}, vocab {model.vocab_size}, "
                    f"{model.param_dtype}; {rope}; max_position_embeddings "
                    f"{model.max_position_embeddings} (longest trained: {trained}); "
                    f"bos {model.bos_id}, eos {list(model.eos_ids)}")
        elif name.startswith("tokenizer") or name == "special_tokens_map.json":
            what = f"from {tokenizer}"
        print(f"  {name:<32} {os.path.getsize(path):>14,} bytes  {what}".rstrip())
    for note in notes:
        print(f"warning: {note}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf")
    src.add_argument("--from-checkpoint")
    dst = ap.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-checkpoint")
    dst.add_argument("--to-hf")
    ap.add_argument("--tokenizer", help="with --to-hf: the tokenizer to export (default: the "
                    "checkpoint's data.tokenizer)")
    logs.configure()
    args = ap.parse_args(argv)

    def body():
        for flag, path in (("--from-hf", args.from_hf), ("--tokenizer", args.tokenizer)):
            problem = path and object_store_problem(path)
            if problem:
                raise StartupError(f"{flag} {path!r} {problem}")
        if args.from_hf and args.to_checkpoint:
            return hf_to_checkpoint(args.from_hf, args.to_checkpoint)
        if args.from_checkpoint and args.to_hf:
            return checkpoint_to_hf(args.from_checkpoint, args.to_hf, args.tokenizer)
        ap.error("use --from-hf with --to-checkpoint, or --from-checkpoint with --to-hf")

    # an unreadable or malformed input (OSError, ValueError from the readers): one line
    return run_cli(body, input_errors=(OSError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
