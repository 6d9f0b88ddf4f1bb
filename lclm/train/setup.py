"""Run set-up: everything between a config and the training loop that involves more than one
component. The cross-component checks (`validate`: the mesh against the devices, kernels,
data sources, divisibility), the workdir probe, the model fields and weights a run takes
from HuggingFace or another lclm run, the attention kernel `auto` resolves to, and what of
the config may leave the process (`public_config`: secrets removed) and wandb.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import tempfile
import uuid

import jax

from lclm import hf, storage
from lclm.checkpoint import (
    Checkpoints,
    ShapeMismatch,
    first_line,
    path_problem,
    read_config,
    read_params,
)
from lclm.config.model import AttentionConfig, LlamaConfig
from lclm.config.schema import MESH_AXES, SOURCE_KINDS, check_fields
from lclm.config.secrets import is_secret, public_config
from lclm.config.stages import validation_lengths
from lclm.data.chat import TEMPLATES
from lclm.data.loader import parse_sources
from lclm.data.sources import names_data
from lclm.errors import ConfigError, StartupError
from lclm.files import output_problem, replacing
from lclm.ops.context_parallel import kernel_block
from lclm.ops.kernels import IMPLS, choose_kernel, get_kernel, platform_family
from lclm.ops.ring_attention import kv_repeats
from lclm.parallel.distributed import any_process
from lclm.parallel.mesh import resolve_mesh_shape
from lclm.train.resume import allowed_keys
from lclm.train.state import TrainState, param_shardings

log = logging.getLogger(__name__)


def _fail(msg: str):
    raise ConfigError(msg)


def validate(config, device_count: int) -> dict[str, int]:
    """Check `config` against itself, the components it names and `device_count`; returns
    the resolved mesh sizes. Raises a one-line ConfigError naming the fix."""
    m, a, d, t = config.model, config.attention, config.data, config.train
    check_fields(config)
    attention = AttentionConfig.from_config(a)
    check_workdir(config.workdir)
    allowed_keys(config)
    try:
        sizes = resolve_mesh_shape(**{k: config.mesh[k] for k in MESH_AXES},
                                   device_count=device_count)
    except ValueError as e:
        _fail(f"config.mesh: {e}")
    dp, fsdp, tp, sp = sizes["dp"], sizes["fsdp"], sizes["tp"], sizes["sp"]

    if a.impl not in IMPLS:
        _fail(f"attention.impl={a.impl!r} is not available; use one of {IMPLS}")
    if d.source not in SOURCE_KINDS:
        _fail(f"data.source={d.source!r}; use one of {SOURCE_KINDS}")
    for key, path in (("data.path", d.path), ("validation.path", config.validation.path)):
        if path:   # the syntax; the planner needs no data (`check_data`: the files)
            parse_sources(path, d.source, key)
    if d.chat_template not in TEMPLATES:
        _fail(f"data.chat_template={d.chat_template!r}; use one of {sorted(TEMPLATES)}")
    if m.n_heads % tp:
        _fail(f"model.n_heads={m.n_heads} is not divisible by mesh.tp={tp}; "
              "pick a tp that divides the head count")
    try:
        kv_repeats(m.n_heads, m.n_kv_heads, tp)
    except ValueError:
        _fail(f"model.n_kv_heads={m.n_kv_heads} cannot be split over mesh.tp={tp}; "
              "pick a tp that divides or is a multiple of n_kv_heads")
    if a.strategy == "ulysses" and m.n_heads % (tp * sp):
        _fail(f"attention.strategy='ulysses' splits the model.n_heads={m.n_heads} query heads "
              f"over mesh.tp x mesh.sp = {tp * sp}: not divisible; use 'usp' with "
              "attention.ulysses dividing them, 'ring' or 'all_gather'")
    if a.strategy == "usp":
        if sp % a.ulysses:
            _fail(f"attention.ulysses={a.ulysses} does not divide mesh.sp={sp}; usp runs "
                  "Ulysses over groups of that many sp devices and the ring across the groups")
        if m.n_heads % (tp * a.ulysses):
            _fail(f"attention.strategy='usp' splits the model.n_heads={m.n_heads} query heads "
                  f"over mesh.tp x attention.ulysses = {tp * a.ulysses}: not divisible; use a "
                  "smaller attention.ulysses")
    elif a.ulysses != 1:
        _fail(f"attention.ulysses={a.ulysses} is usp's Ulysses degree; set "
              "attention.strategy='usp' or leave attention.ulysses=1")
    if m.ffn_dim % tp:
        _fail(f"model.ffn_dim={m.ffn_dim} is not divisible by mesh.tp={tp}")

    if d.seq_len % sp:
        _fail(f"data.seq_len={d.seq_len} is not divisible by mesh.sp={sp}; "
              f"use a multiple of {sp}")
    local = d.seq_len // sp
    # the layout's shards: the ring's members (usp: sp / ulysses, a shard cut over its group)
    ring = attention.ring_size(sp)
    shard, what = d.seq_len // ring, "mesh.sp" if ring == sp else "mesh.sp / attention.ulysses"
    # zigzag: each shard holds two runs of consecutive positions; tiles stay inside one
    runs = 2 if a.layout == "zigzag" and ring > 1 else 1
    if shard % runs:
        _fail(f"data.seq_len={d.seq_len} is not divisible by 2 x {what} = {2 * ring}, as "
              f"attention.layout='zigzag' needs; use a multiple of {2 * ring}")
    # the run of positions the kernel's tiles stay inside (ulysses: the whole sequence)
    run = kernel_block(attention, sp, d.seq_len)
    for key in ("q_chunk", "kv_chunk"):
        chunk = min(a[key], run)
        if run % chunk == 0:
            continue
        if a.strategy == "ulysses":
            _fail(f"data.seq_len={d.seq_len} is not divisible by attention.{key}={chunk}; "
                  f"use a multiple of {chunk}")
        else:
            twice = f"2 x {what}" if runs == 2 else what
            _fail(f"data.seq_len={d.seq_len} is not divisible by {twice} x attention.{key} = "
                  f"{runs * ring} x {chunk}; use a multiple of {runs * ring * chunk}")
    for key in ("ffn_chunk", "loss_chunk"):
        chunk = min(m[key], local)
        if local % chunk:
            _fail(f"data.seq_len={d.seq_len} is not divisible by mesh.sp x model.{key} = "
                  f"{sp} x {chunk}; use a multiple of {sp * chunk}")
    # 'auto' is resolved per platform (`attention_kernel`), always to a kernel that can serve
    why = None if a.impl == "auto" else get_kernel(a.impl).limits(
        head_dim=m.dim // m.n_heads, q_chunk=a.q_chunk, kv_chunk=a.kv_chunk,
        block=run, dtype=m.dtype)
    if why is not None:
        _fail(f"attention.impl={a.impl!r} cannot serve this model: {why}; "
              "attention.impl='auto' picks a kernel that can")
    if d.batch_size % t.grad_accum:
        _fail(f"data.batch_size={d.batch_size} is not divisible by train.grad_accum="
              f"{t.grad_accum}")
    micro = d.batch_size // t.grad_accum
    if micro % (dp * fsdp):
        _fail(f"micro-batch data.batch_size/train.grad_accum={micro} is not divisible by "
              f"mesh.dp x mesh.fsdp = {dp * fsdp}; change the batch size or the mesh")
    for length in validation_lengths(config):
        if length != d.seq_len and config.validation.path:
            # a held-out batch at another length must split over the mesh as training's does
            held_out = copy.deepcopy(config)
            held_out.data.seq_len, held_out.validation.lengths = length, ""
            try:
                validate(held_out, device_count)
            except ConfigError as e:
                _fail(f"validation.lengths={config.validation.lengths!r}, length {length}: {e}")
    return sizes


def check_data(config) -> None:
    """Fail at start, naming the key, when a source of `data.path` or `validation.path` names
    nothing: found before the model is initialised, not when the loader first opens it."""
    for key, path in (("data.path", config.data.path),
                      ("validation.path", config.validation.path)):
        if not path:
            continue
        for kind, source, _ in parse_sources(path, config.data.source, key):
            # synthetic sources hold options, not paths; hub datasets are found by `datasets`
            if kind == "line_retrieval" or source.startswith("hub:"):
                continue
            problem = storage.client_problem(source)
            if problem:
                _fail(f"config.{key}: {source!r} {problem}")
            if names_data(source):   # on gs:// and s3:// looked up in the bucket
                continue
            comma = " (in a mixture, write a ',' of a file name as '\\,')" if "," in path else ""
            _fail(f"config.{key}: no data at {source!r}; point it at a "
                  f".jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob{comma}")


def _probe_dir(directory: str) -> str | None:
    """Why a new file cannot be made in `directory` (None: it can); leaves nothing behind."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as e:
        return e.strerror or str(e)


# what a run writes in its workdir besides new files: found unwritable at start, not after
# a week of training at the final save
_OUTPUT_DIRS = ("", "checkpoints")
_OUTPUT_FILES = ("config.json", "metrics.jsonl", "wandb_id")


def check_workdir(workdir: str) -> None:
    """Fail at start, not at the first save, when the run cannot write its workdir, its
    checkpoint directory or the files it appends to. Leaves nothing behind: the probes are
    temporary files, and existing files are opened for appending without writing."""
    if not workdir:
        _fail("workdir is empty; set config.workdir to the run's directory")
    if storage.is_remote(workdir):   # a bucket: that it exists and takes this host's writes
        problem = (storage.client_problem(workdir) or path_problem(workdir)
                   or output_problem(workdir, remote=True))
        if problem:
            _fail(f"workdir={workdir!r} {problem}")
        return
    problem = path_problem(os.path.abspath(workdir))
    if problem:
        _fail(f"workdir={workdir!r} {problem}")
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        _fail(f"workdir={workdir!r}: {existing!r} is not a directory; set config.workdir to a "
              "directory path")
    why = _probe_dir(existing)
    if why:
        _fail(f"workdir={workdir!r}: cannot write in {existing!r} ({why}); set "
              "config.workdir to a writable directory")
    for sub in _OUTPUT_DIRS:
        path = os.path.join(workdir, sub)
        why = _probe_dir(path) if sub and os.path.isdir(path) else None
        if why:
            _fail(f"workdir={workdir!r}: cannot write in {path!r} ({why}); make it writable "
                  "or use another workdir")
    for name in _OUTPUT_FILES:
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            try:
                with open(path, "a"):
                    pass
            except OSError as e:
                _fail(f"workdir={workdir!r}: cannot write {path!r} ({e.strerror}); make it "
                      "writable or use another workdir")


def apply_hf_shapes(config) -> None:
    """Take the fields of `config.model` that `init_from_hf`'s config.json determines: shapes,
    token ids, max positions and, where `model.rope_scaling` is 'auto', the RoPE scaling.
    `model.rope_theta` stays the run's (long-context recipes raise it)."""
    source = hf.read_config(config.model.init_from_hf)
    config.model.update(hf.model_fields(dataclasses.asdict(source),
                                        rope_scaling=config.model.rope_scaling == "auto"))
    if source.rope_theta != config.model.rope_theta:
        log.info("model.rope_theta=%g replaces %s's rope_theta %g", config.model.rope_theta,
                 config.model.init_from_hf, source.rope_theta)


class SourceDamaged(StartupError):
    """The latest checkpoint of `model.init_from_checkpoint` cannot be read."""

    def __init__(self, workdir: str, step: int | None, why: str):
        self.workdir, self.step, self.why = workdir, step, why
        where = os.path.join(workdir, "checkpoints", "<step>" if step is None else str(step))
        super().__init__(
            f"model.init_from_checkpoint={workdir!r}: its latest checkpoint"
            f"{'' if step is None else f' (step {step})'} cannot be read ({why}); move {where} "
            "aside to start from that run's previous step, or point "
            "model.init_from_checkpoint at another run")


def apply_checkpoint_fields(config) -> None:
    """Take the fields of `config.model` that `init_from_checkpoint`'s saved config
    determines, as `apply_hf_shapes` does for HF weights: shapes, token ids, max positions
    and, where `model.rope_scaling` is 'auto', the RoPE scaling it trained with."""
    source = config.model.init_from_checkpoint
    try:
        _, saved = read_config(source)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001  (a damaged config item)
        raise SourceDamaged(source, None, first_line(e)) from None
    config.model.update(hf.model_fields(saved.get("model", {}),
                                        rope_scaling=config.model.rope_scaling == "auto"))


def load_hf_params(config, model: LlamaConfig, mesh):
    """`init_from_hf` weights in the run's param dtype and shardings."""
    # each device's block is read from the files and placed where it belongs: the model is
    # never whole on one device nor on the host (13B in float32 is 52 GB)
    _, params = hf.load(config.model.init_from_hf, shardings=param_shardings(model, mesh),
                        dtype=model.param_dtype)
    log.info("initialised from %s (rope_theta %g)", config.model.init_from_hf, model.rope_theta)
    return params


def load_checkpoint_params(config, template: TrainState):
    """The latest parameters of the lclm run in `init_from_checkpoint`, placed like
    `template.params` (its optimizer state is not read)."""
    source = config.model.init_from_checkpoint
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            template.params)
    checkpoints = Checkpoints(source, every=0, keep=1)
    error, params = None, None
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise FileNotFoundError(f"model.init_from_checkpoint={source!r} has no checkpoint; "
                                    "point it at the workdir of a finished lclm run")
        try:
            checkpoints.check_shapes(step, template.params)
            params = read_params(source, step, abstract)
        except ShapeMismatch:
            raise
        except Exception as e:  # noqa: BLE001  (truncated, garbage, missing files)
            error = e
    finally:
        checkpoints.close()
    if any_process(error is not None):  # every process stops, or none
        raise SourceDamaged(source, step, first_line(error) if error else
                            "unreadable on another process")
    log.info("initialised from %s step %d", source, step)
    return params


def attention_kernel(config, model: LlamaConfig, sp: int, platform: str) -> str:
    """The kernel the ring will run (`attention.impl`, 'auto' resolved); an explicit kernel
    that cannot run on this platform is a config error here, at start, not a traceback
    inside the step."""
    a = config.attention
    try:
        return choose_kernel(a.impl, head_dim=model.dim // model.n_heads, q_chunk=a.q_chunk,
                             kv_chunk=a.kv_chunk, platform=platform, dtype=model.dtype,
                             block=kernel_block(AttentionConfig.from_config(a), sp,
                                                config.data.seq_len))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def attention_line(config, model: LlamaConfig, sp: int, platform: str) -> str:
    kernel = attention_kernel(config, model, sp, platform)
    chosen = f" (auto on {platform_family(platform)})" if config.attention.impl == "auto" else ""
    a = AttentionConfig.from_config(config.attention)
    strategy = "" if a.strategy == "ring" else f", {a.strategy} strategy"
    if a.strategy == "usp":
        strategy += f" (ulysses {a.ulysses} x ring {a.ring_size(sp)})"
    return f"{kernel}{chosen}, {a.layout} layout{strategy}"


def wandb_run(config, resume_step: int):
    """The wandb run of this workdir: the same run id across resumes (`<workdir>/wandb_id`),
    so a resumed run continues its run instead of starting a second one."""
    if not config.log.wandb or jax.process_index() != 0:
        return None
    import wandb  # 0.4 s to import: only runs that log to wandb pay it
    mode = os.environ.get("WANDB_MODE", config.log.wandb_mode)  # the environment wins
    id_path = storage.join(config.workdir, "wandb_id")
    if storage.isfile(id_path):
        run_id = storage.read_text(id_path).strip()
    else:
        run_id = uuid.uuid4().hex[:16]  # wandb ids: letters and digits
        with replacing(id_path) as f:
            f.write(run_id)
    # wandb records the command line; not when an override on it names a secret
    secret_args = any(is_secret(a.split("=")[0].rsplit(".", 1)[-1].lstrip("-"))
                      for a in sys.argv[1:])
    settings = wandb.Settings(x_disable_meta=True) if secret_args else None
    if resume_step:
        log.info("wandb: resuming run %s after step %d (wandb keeps the values it already "
                 "has for re-run steps; metrics.jsonl holds the re-run ones)", run_id,
                 resume_step)
    # wandb keeps its own files in a local folder: its default (./wandb) for a bucket workdir
    local = None if storage.is_remote(config.workdir) else config.workdir
    return wandb.init(project=config.log.wandb_project, mode=mode, dir=local,
                      config=public_config(config), id=run_id, resume="allow",
                      settings=settings)
