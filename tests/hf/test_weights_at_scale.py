"""HF weights at scale: each device's block is read from the files and placed directly (no
device or host ever holds the whole model), and an export replaces an earlier one only once
it is complete."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import safetensors.numpy
from support import ROOT

from lclm import hf
from lclm.config import LlamaConfig
from lclm.models.llama import init_params
from lclm.parallel import make_mesh
from lclm.train.state import param_shardings

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128,
                    param_dtype="float32")


@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(fsdp=2, tp=2, sp=2)])
def test_a_sharded_load_places_each_block_and_equals_the_whole_load(tmp_path, mesh):
    hf.save(str(tmp_path), SMALL, init_params(SMALL, jax.random.key(3)), max_shard_bytes=1 << 17)
    _, whole = hf.load(str(tmp_path))
    shardings = param_shardings(SMALL, make_mesh(**mesh))
    _, placed = hf.load(str(tmp_path), shardings=shardings)
    for a, b, sharding in zip(jax.tree.leaves(whole), jax.tree.leaves(placed),
                              jax.tree.leaves(shardings)):
        np.testing.assert_array_equal(a, np.asarray(b))
        assert b.sharding == sharding
        block = sharding.shard_shape(b.shape)
        assert all(s.data.shape == block for s in b.addressable_shards)
    assert placed["layers"]["wq"].addressable_shards[0].data.shape[1] < SMALL.dim


_WRITE = textwrap.dedent("""
    import sys, numpy as np
    from lclm import hf
    from lclm.config import LlamaConfig
    from lclm.models.llama import param_shapes
    import jax
    c = LlamaConfig(vocab_size=32000, dim=2048, n_layers=20, n_heads=32, n_kv_heads=8,
                    ffn_dim=5632, param_dtype="float32")
    # cheap, distinct values: the load is what is measured
    params = jax.tree.map(lambda s: np.full(s, 0.01, np.float32), param_shapes(c),
                          is_leaf=lambda x: isinstance(x, tuple))
    hf.save(sys.argv[1], c, params, max_shard_bytes=1 << 30)
""")

_LOAD = textwrap.dedent("""
    import os, sys, jax, numpy as np
    from lclm import hf
    from lclm.parallel import make_mesh
    from lclm.train.state import param_shardings
    c = hf.read_config(sys.argv[1])
    shardings = param_shardings(c, make_mesh(fsdp=8))
    _, params = hf.load(sys.argv[1], shardings=shardings)
    jax.block_until_ready(params)
    whole = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    biggest = max(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(whole, biggest, int(peak) * 1024)
""")


@pytest.mark.slow
def test_a_1b_checkpoint_loads_onto_8_devices_in_under_1_5x_its_size(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    directory = str(tmp_path / "hf")
    subprocess.run([sys.executable, "-c", _WRITE, directory], cwd=ROOT, env=env, check=True,
                   timeout=300)
    on_disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    done = subprocess.run([sys.executable, "-c", _LOAD, directory], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    params, biggest, peak = map(int, done.stdout.split())
    assert params > 1e9
    # fsdp=8: the largest block any device holds is an eighth of the largest stacked tensor
    assert biggest <= 20 * 2048 * 5632 * 4 // 8
    assert peak < 1.5 * on_disk, (peak / 2**30, on_disk / 2**30)


def test_a_failed_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    first = init_params(SMALL, jax.random.key(1))
    hf.save(str(tmp_path), SMALL, first, max_shard_bytes=1 << 17)
    before = sorted(os.listdir(tmp_path))
    calls = []

    def fail_on_the_second_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save_file(tensors, path, metadata=metadata)

    save_file = safetensors.numpy.save_file
    monkeypatch.setattr("lclm.hf.weights.save_file", fail_on_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        hf.save(str(tmp_path), SMALL, init_params(SMALL, jax.random.key(2)),
                max_shard_bytes=1 << 17)
    assert sorted(os.listdir(tmp_path)) == before   # no staging directory left either
    _, loaded = hf.load(str(tmp_path))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), b)

    monkeypatch.undo()   # a re-export into one file replaces the earlier shards entirely
    assert hf.save(str(tmp_path), SMALL, first) == ["model.safetensors", "config.json"]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
