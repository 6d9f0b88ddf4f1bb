"""The checks a run makes at start, before any work, of everything its config names together:
the mesh against the devices, the attention kernel and strategy against the model, data
sources, divisibility of lengths, batches and chunks (`validate`; `checked` also gives the
typed sections), the data paths
(`check_data`), and the kernel `attention.impl='auto'` resolves to. Each failure is one
line naming the fix (ConfigError). The single-field checks are lclm.config.schema's.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import NamedTuple

from ml_collections import ConfigDict

from lclm import storage
from lclm.config.loading import field
from lclm.config.model import AttentionConfig, ModelConfig
from lclm.config.run_config import RunConfig, run_config
from lclm.config.schema import MESH_AXES, check_fields
from lclm.config.stages import validation_lengths
from lclm.data.chat import TEMPLATE_NAMES
from lclm.data.kind import DIRECTORY, OPTIONS
from lclm.data.loader import parse_sources
from lclm.data.records import names_data
from lclm.data.sources import get_kind
from lclm.errors import ConfigError
from lclm.ops.context_parallel import kernel_block, layout_shards, option_problem, strategy_of
from lclm.ops.context_parallel.rounds import kv_repeats
from lclm.ops.kernels import choose_kernel, get_kernel, platform_family
from lclm.parallel.mesh import fit_mesh, resolve_mesh_shape
from lclm.workdir.layout import check_workdir
from lclm.workdir.resume import allowed_keys

log = logging.getLogger(__name__)


def _fail(msg: str):
    raise ConfigError(msg)


class Checked(NamedTuple):
    """A run's config checked and typed: `config`, a copy of the user's with the mesh it
    resolved (what the run's config.json names); `sections`, its typed tree (`RunConfig`);
    `mesh`, the mesh's sizes for the devices."""

    config: ConfigDict
    sections: RunConfig
    mesh: dict[str, int]


def checked(config: ConfigDict, device_count: int) -> Checked:
    """`validate(config, device_count)`, then the config's typed sections: what every
    program that runs or compiles a step starts from (one ConfigError line on a bad
    config). `config` itself is left as it is."""
    sizes = validate(config, device_count)
    config = with_mesh(config, sizes)
    return Checked(config, run_config(config), sizes)


def with_mesh(config: ConfigDict, sizes: dict[str, int]) -> ConfigDict:
    """A copy of `config` with the mesh `validate` resolved (`sizes`) where `mesh.fit` shrank
    the one asked for, so that the run's config.json names the mesh it ran on (what generate
    and the evaluations default to). A mesh with an axis of -1 is kept as written: that axis
    takes the devices of whichever machine reads the config."""
    config = copy.deepcopy(config)
    asked = {axis: config.mesh[axis] for axis in MESH_AXES}
    if -1 not in asked.values() and sizes != asked:
        config.mesh.update(sizes)
    return config


def validate(config, device_count: int) -> dict[str, int]:
    """`check_config`, then that the run can write its workdir (`check_workdir`); returns
    the resolved mesh sizes."""
    sizes = check_config(config, device_count)
    check_workdir(config.workdir)
    return sizes


def check_config(config, device_count: int) -> dict[str, int]:
    """Check `config` against itself, the components it names and `device_count`, touching
    no file of the run (what `--print-config` checks too: `stages.check_stages`); returns
    the resolved mesh sizes (`with_mesh` makes the config that runs on them). Raises a
    one-line ConfigError naming the fix."""
    m, a, d, t = config.model, config.attention, config.data, config.train
    check_fields(config)
    attention = AttentionConfig.from_config(a)
    for key in allowed_keys(config.checkpoint.allow_changed):
        field(config, key)  # one line naming the unknown key
    try:
        asked = {k: config.mesh[k] for k in MESH_AXES}
        fitted = (
            asked if not config.mesh.fit or -1 in asked.values() else fit_mesh(asked, device_count)
        )
        sizes = resolve_mesh_shape(**fitted, device_count=device_count)
    except ValueError as e:
        _fail(f"config.mesh: {e}")
    if fitted != asked:
        log.info(
            "mesh %s needs more than the %d devices here: fitted to %s (mesh.fit)",
            asked,
            device_count,
            sizes,
        )
    dp, fsdp, tp, sp = sizes["dp"], sizes["fsdp"], sizes["tp"], sizes["sp"]

    for key, path in (("data.path", d.path), ("validation.path", config.validation.path)):
        if path:  # the syntax; the planner needs no data (`check_data`: the files)
            parse_sources(path, d.source, key)
    if d.chat_template not in TEMPLATE_NAMES:
        _fail(f"data.chat_template={d.chat_template!r}; use one of {sorted(TEMPLATE_NAMES)}")
    if m.n_heads % tp:
        _fail(
            f"model.n_heads={m.n_heads} is not divisible by mesh.tp={tp}; "
            "pick a tp that divides the head count"
        )
    try:
        kv_repeats(m.n_heads, m.n_kv_heads, tp)
    except ValueError:
        _fail(
            f"model.n_kv_heads={m.n_kv_heads} cannot be split over mesh.tp={tp}; "
            "pick a tp that divides or is a multiple of n_kv_heads"
        )
    why = option_problem(a) or strategy_of(a).limits(heads=m.n_heads, tp=tp, sp=sp)
    if why is not None:
        _fail(why)
    if m.ffn_dim % tp:
        _fail(f"model.ffn_dim={m.ffn_dim} is not divisible by mesh.tp={tp}")

    if d.seq_len % sp:
        _fail(f"data.seq_len={d.seq_len} is not divisible by mesh.sp={sp}; use a multiple of {sp}")
    local = d.seq_len // sp
    # the layout's shards (sp; usp: sp / ulysses, a shard cut over its group)
    shards = layout_shards(attention, sp)
    shard, what = d.seq_len // shards, "mesh.sp" if shards == sp else "mesh.sp / attention.ulysses"
    # zigzag: each shard holds two runs of consecutive positions; tiles stay inside one
    runs = 2 if a.layout == "zigzag" and shards > 1 else 1
    if shard % runs:
        _fail(
            f"data.seq_len={d.seq_len} is not divisible by 2 x {what} = {2 * shards}, as "
            f"attention.layout='zigzag' needs; use a multiple of {2 * shards}"
        )
    # the run of positions the kernel's tiles stay inside (ulysses: the whole sequence)
    run = kernel_block(attention, sp, d.seq_len)
    for key in ("q_chunk", "kv_chunk"):
        chunk = min(a[key], run)
        if run % chunk == 0:
            continue
        if run == d.seq_len:  # the whole sequence in original order (ulysses, or sp=1)
            _fail(
                f"data.seq_len={d.seq_len} is not divisible by attention.{key}={chunk}; "
                f"use a multiple of {chunk}"
            )
        else:
            twice = f"2 x {what}" if runs == 2 else what
            _fail(
                f"data.seq_len={d.seq_len} is not divisible by {twice} x attention.{key} = "
                f"{runs * shards} x {chunk}; use a multiple of {runs * shards * chunk}"
            )
    for key in ("ffn_chunk", "loss_chunk"):
        chunk = min(m[key], local)
        if local % chunk:
            _fail(
                f"data.seq_len={d.seq_len} is not divisible by mesh.sp x model.{key} = "
                f"{sp} x {chunk}; use a multiple of {sp * chunk}"
            )
    # 'auto' is resolved per platform (`attention_kernel`), always to a kernel that can serve
    why = (
        None
        if a.impl == "auto"
        else get_kernel(a.impl).limits(
            head_dim=ModelConfig.from_config(m).head_dim,
            q_chunk=a.q_chunk,
            kv_chunk=a.kv_chunk,
            block=run,
            dtype=m.dtype,
        )
    )
    if why is not None:
        _fail(
            f"attention.impl={a.impl!r} cannot serve this model: {why}; "
            "attention.impl='auto' picks a kernel that can"
        )
    if d.batch_size % t.grad_accum:
        _fail(f"data.batch_size={d.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    micro = d.batch_size // t.grad_accum
    if micro % (dp * fsdp):
        _fail(
            f"micro-batch data.batch_size/train.grad_accum={micro} is not divisible by "
            f"mesh.dp x mesh.fsdp = {dp * fsdp}; change the batch size or the mesh"
        )
    for length in validation_lengths(d.seq_len, config.validation.lengths):
        if length != d.seq_len and config.validation.path:
            # a held-out batch at another length must split over the mesh as training's does
            held_out = copy.deepcopy(config)
            held_out.data.seq_len, held_out.validation.lengths = length, ""
            try:
                check_config(held_out, device_count)
            except ConfigError as e:
                _fail(f"validation.lengths={config.validation.lengths!r}, length {length}: {e}")
    return sizes


def check_data(config) -> None:
    """Fail at start, naming the key, when a source of `data.path` or `validation.path` names
    nothing: found before the model is initialised, not when the loader first opens it."""
    for key, path in (("data.path", config.data.path), ("validation.path", config.validation.path)):
        if not path:
            continue
        for kind, source, *_ in parse_sources(path, config.data.source, key):
            what = get_kind(kind)
            # hub datasets are found by `datasets`
            if what.path == OPTIONS or source.startswith("hub:"):
                continue
            if what.path == DIRECTORY:
                if not os.path.isdir(source):
                    _fail(
                        f"config.{key}: {kind}:{source!r} is not a local directory; point "
                        f"it at {what.path_help}"
                    )
                continue
            problem = storage.client_problem(source)
            if problem:
                _fail(f"config.{key}: {source!r} {problem}")
            if names_data(source):  # on gs:// and s3:// looked up in the bucket
                continue
            comma = " (in a mixture, write a ',' of a file name as '\\,')" if "," in path else ""
            _fail(
                f"config.{key}: no data at {source!r}; point it at a "
                f".jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob{comma}"
            )


def attention_kernel(
    a: AttentionConfig, seq_len: int, model: ModelConfig, sp: int, platform: str
) -> str:
    """The kernel the attention `a` of sequences of `seq_len` will run (`attention.impl`,
    'auto' resolved); an explicit kernel that cannot run on this platform is a config error
    here, at start, not a traceback inside the step."""
    try:
        return choose_kernel(
            a.impl,
            head_dim=model.head_dim,
            q_chunk=a.q_chunk,
            kv_chunk=a.kv_chunk,
            platform=platform,
            dtype=model.dtype,
            block=kernel_block(a, sp, seq_len),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def attention_line(
    a: AttentionConfig, seq_len: int, model: ModelConfig, sp: int, platform: str
) -> str:
    """The start-up log's words for the attention: kernel, layout and strategy."""
    kernel = attention_kernel(a, seq_len, model, sp, platform)
    chosen = f" (auto on {platform_family(platform)})" if a.impl == "auto" else ""
    strategy = "" if a.strategy == "ring" else f", {strategy_of(a).label(sp)} strategy"
    return f"{kernel}{chosen}, {a.layout} layout{strategy}"
