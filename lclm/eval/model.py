"""The model an evaluation CLI decodes with: an lclm checkpoint (its saved config, tokenizer
and mesh) or a HuggingFace model directory, its parameters placed on a mesh, and the flags
that choose it (`add_model_arguments`), shared by `lclm.eval.line_retrieval` and
`lclm.eval.generate`.

Loading reads Orbax tensors, JSON, safetensors and a tokenizer file only: nothing is unpickled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax

from lclm import hf, storage
from lclm.config import MESH_AXES, AttentionConfig, ModelConfig
from lclm.config.fields import from_saved
from lclm.config.model import DTYPES, ROPE_SCALINGS
from lclm.data.tokenizer import Tokenizer
from lclm.errors import StartupError
from lclm.models.decoder import param_shapes
from lclm.ops.context_parallel import STRATEGIES
from lclm.ops.layout import LAYOUTS
from lclm.parallel.devices import available, request_cpu_devices
from lclm.parallel.mesh import make_mesh, resolve_mesh_shape
from lclm.workdir.checkpoint import read_checkpoint, read_params
from lclm.workdir.layout import workdir_to_read
from lclm.workdir.state import param_shardings
from lclm.writes import check_input


@dataclasses.dataclass
class LoadedModel:
    """What evaluation needs: configs, parameters placed on `mesh`, tokenizer, description."""

    config: ModelConfig
    attention: AttentionConfig
    params: dict
    mesh: jax.sharding.Mesh
    tokenizer: Tokenizer
    name: str


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """--checkpoint WORKDIR | --hf HF_DIR (one required), --step, --tokenizer, the mesh sizes
    and the attention layout and chunks (default: the checkpoint's)."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint",
        help="an lclm training workdir (a staged run's: its last stage with a checkpoint)",
    )
    src.add_argument("--hf", help="a HuggingFace directory (safetensors) of a family lclm knows")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument(
        "--tokenizer",
        help="SentencePiece .model, tokenizer.json or a directory "
        "holding one (default: the run's; HF_DIR with --hf)",
    )
    for axis in MESH_AXES:
        ap.add_argument(
            f"--{axis}",
            type=int,
            default=None,
            help=f"mesh.{axis} (default: the checkpoint's; 1 with --hf)",
        )
    ap.add_argument("--layout", choices=LAYOUTS, default=None)
    ap.add_argument("--q-chunk", type=int, default=None)
    ap.add_argument("--kv-chunk", type=int, default=None)
    ap.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=None,
        help="attention.strategy of the prefill (default: the checkpoint's)",
    )
    ap.add_argument(
        "--ulysses",
        type=int,
        default=None,
        help="attention.ulysses, usp's Ulysses degree (default: the checkpoint's)",
    )
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute dtype (default: the checkpoint's; with --hf the config's "
        "torch_dtype): two models compared at the same one differ only in "
        "their weights",
    )
    ap.add_argument(
        "--rope-scaling",
        choices=ROPE_SCALINGS,
        default=None,
        help="RoPE scaling at inference, over the model's own (default: the "
        "model's): e.g. yarn with --rope-factor 4 reads 4x the trained context "
        "without training",
    )
    ap.add_argument(
        "--rope-factor",
        type=float,
        default=None,
        help="the scaling's factor (default: the model's)",
    )
    ap.add_argument(
        "--rope-original-max-positions",
        type=int,
        default=None,
        help="the context the scaling starts from (default: the model's "
        "max_position_embeddings, the context it was trained at)",
    )


def load_model(args) -> tuple[LoadedModel, dict | None]:
    """(the LoadedModel the flags of `add_model_arguments` name, the checkpoint's saved config or
    None for --hf). Call before JAX starts: the mesh's devices are simulated on a CPU."""
    check_input("--hf", args.hf)
    workdir = workdir_to_read(args.checkpoint) if args.checkpoint else None
    request_cpu_devices(_requested_devices(args, workdir))  # no effect once JAX has started
    model, saved = load_checkpoint(args, workdir) if workdir else (load_hf(args), None)
    return _rescaled(_computed_in(model, getattr(args, "dtype", None)), args), saved


def _computed_in(model: LoadedModel, dtype: str | None) -> LoadedModel:
    """`model` computing in `dtype` (None: as it is); its parameters keep theirs."""
    if dtype is None or dtype == model.config.dtype:
        return model
    return dataclasses.replace(model, config=dataclasses.replace(model.config, dtype=dtype))


def _rescaled(model: LoadedModel, args) -> LoadedModel:
    """`model` with the RoPE scaling of --rope-scaling / --rope-factor /
    --rope-original-max-positions (the weights are the same: RoPE has no parameters)."""
    changes = {
        k: v
        for k, v in (
            ("rope_scaling", getattr(args, "rope_scaling", None)),
            ("rope_factor", getattr(args, "rope_factor", None)),
            ("rope_original_max_positions", getattr(args, "rope_original_max_positions", None)),
        )
        if v is not None
    }
    if not changes:
        return model
    if "rope_original_max_positions" not in changes and "rope_scaling" in changes:
        changes["rope_original_max_positions"] = model.config.max_position_embeddings
    if changes.get("rope_factor", 1.0) <= 0 or changes.get("rope_original_max_positions", 1) < 1:
        raise StartupError("--rope-factor and --rope-original-max-positions must be positive")
    config = dataclasses.replace(model.config, **changes)
    rope = (
        f"rope {config.rope_scaling} x{config.rope_factor:g} from "
        f"{config.rope_original_max_positions}"
    )
    return dataclasses.replace(model, config=config, name=f"{model.name}, {rope}")


def restore_params(workdir: str, step: int, model_config, mesh) -> dict:
    """The parameters of checkpoint `step`, placed with the training shardings on `mesh`
    (optimizer state and data state are not read)."""
    dtype = jax.numpy.dtype(model_config.param_dtype)
    abstract = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
        param_shapes(model_config),
        param_shardings(model_config, mesh),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return read_params(workdir, step, abstract)


def load_checkpoint(args, workdir: str) -> tuple[LoadedModel, dict]:
    """The model of the lclm run in `workdir` (what `lclm.workdir.layout.workdir_to_read`
    finds for `--checkpoint`) at `--step`, or at its latest readable step (a damaged one is
    named and the previous one read: `lclm.workdir.checkpoint.read_checkpoint`); returns
    (LoadedModel, the saved config)."""

    def name(step: int) -> str:
        return f"{storage.basename(storage.absolute(workdir))} step {step}"

    def load(step: int, saved: dict):
        model_config = from_saved(ModelConfig, saved["model"])
        mesh = make_mesh(**_mesh_sizes(saved.get("mesh", {}), args, name(step)))
        return model_config, mesh, restore_params(workdir, step, model_config, mesh)

    step, saved, (model_config, mesh, params) = read_checkpoint(workdir, args.step, load)
    attention = _attention(from_saved(AttentionConfig, saved["attention"]), args)
    tokenizer = Tokenizer(args.tokenizer or saved["data"]["tokenizer"])
    tokenizer.check_fits(model_config.vocab_size)
    return LoadedModel(model_config, attention, params, mesh, tokenizer, name(step)), saved


def load_hf(args) -> LoadedModel:
    """A HuggingFace model directory (safetensors; local, gs:// or s3://, read from a local
    copy) with its tokenizer (tokenizer.json or tokenizer.model in the directory, or
    --tokenizer)."""
    with hf.local_copy(args.hf) as local:
        model_config = hf.read_config(local)
        tokenizer = Tokenizer(args.tokenizer or local)
        tokenizer.check_fits(model_config.vocab_size)
        mesh = make_mesh(**_mesh_sizes({}, args, None))
        # each device reads its own block of the weights: the model is never whole on one
        model_config, params = hf.load(local, shardings=param_shardings(model_config, mesh))
    attention = _attention(AttentionConfig(), args)
    return LoadedModel(
        model_config,
        attention,
        params,
        mesh,
        tokenizer,
        storage.basename(storage.absolute(args.hf)),
    )


def answer_text(tokenizer, ids, stop_id: int | None = None) -> str:
    """Decoded generation up to (not including) the first EOS, or the first `stop_id`."""
    ids = [int(i) for i in ids]
    for end in (tokenizer.eos_id, stop_id):
        if end is not None and end in ids:
            ids = ids[: ids.index(end)]
    return tokenizer.decode(ids)


def _mesh_sizes(saved_mesh: dict, args, name: str | None) -> dict:
    """Saved mesh sizes (of checkpoint `name`; None: 1 each) with the flags' overrides, -1
    resolved against the devices; a mesh that cannot be made is one line naming the flags
    that change it (the saved mesh is only a default: parameters load onto any mesh)."""
    sizes = {a: int(saved_mesh.get(a, 1)) for a in MESH_AXES}
    flags = {a: getattr(args, a) for a in MESH_AXES if getattr(args, a) is not None}
    sizes.update(flags)
    count = len(jax.devices())
    origin = " with ".join(
        part
        for part in (
            f"{name}'s training mesh" if name else "",
            " ".join(f"--{a} {v}" for a, v in flags.items()),
        )
        if part
    )
    one = " ".join(f"--{a} 1" for a in MESH_AXES if sizes[a] != 1)
    fix = (
        f"pass --dp/--fsdp/--tp/--sp sizes whose product is at most {count} (e.g. {one}); "
        "the parameters load onto any mesh"
    )
    need = math.prod(sizes.values())
    if -1 not in sizes.values() and need > count:
        raise StartupError(
            f"the mesh {sizes} ({origin}) needs {need} devices but "
            f"{available(jax.devices())}; {fix}"
        )
    try:
        return resolve_mesh_shape(**sizes, device_count=count)
    except ValueError as e:
        raise StartupError(f"{e} ({origin}); {fix}") from None


def _attention(attention, args):
    changes = {
        k: getattr(args, k)
        for k in ("layout", "q_chunk", "kv_chunk", "strategy", "ulysses")
        if getattr(args, k) is not None
    }
    return dataclasses.replace(attention, **changes)


def _requested_devices(args, workdir: str | None) -> int:
    """Devices the mesh will need, read before JAX starts (simulated on a CPU): the flags,
    else the `config.json` of the run in `workdir` (the one whose checkpoint is read, not a
    staged run's directory); -1 counts as 1."""
    saved = {}
    config = storage.join(workdir, "config.json") if workdir else ""
    if config and storage.isfile(config):
        saved = json.loads(storage.read_text(config)).get("mesh", {})
    sizes = [
        getattr(args, a) if getattr(args, a) is not None else saved.get(a, 1) for a in MESH_AXES
    ]
    return math.prod(max(1, int(s)) for s in sizes)
