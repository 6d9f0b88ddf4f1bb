"""HF weights at scale: each device's block is read from the files and placed directly (no
device or host ever holds the whole model), an export streams one tensor at a time, and an
export replaces an earlier one only once it is complete."""

import os
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from support import ROOT

from lclm import hf
from lclm.config import ModelConfig
from lclm.models.decoder import init_params
from lclm.parallel import make_mesh
from lclm.workdir.state import param_shardings

SMALL = ModelConfig(
    vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, param_dtype="float32"
)
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")


@pytest.mark.parametrize(
    "mesh,dtype",
    [(dict(fsdp=8), None), (dict(fsdp=2, tp=2, sp=2), None), (dict(tp=4, fsdp=2), "bfloat16")],
)
def test_a_sharded_load_places_each_block_and_equals_the_whole_load(tmp_path, mesh, dtype):
    hf.save(str(tmp_path), SMALL, init_params(SMALL, jax.random.key(3)), max_shard_bytes=1 << 17)
    _, whole = hf.load(str(tmp_path), dtype=dtype)
    shardings = param_shardings(SMALL, make_mesh(**mesh))
    _, placed = hf.load(str(tmp_path), shardings=shardings, dtype=dtype)
    for a, b, sharding in zip(
        jax.tree.leaves(whole), jax.tree.leaves(placed), jax.tree.leaves(shardings)
    ):
        assert a.dtype == b.dtype == jnp.dtype(dtype or SMALL.param_dtype)
        np.testing.assert_array_equal(a, np.asarray(b))
        assert b.sharding == sharding
        block = sharding.shard_shape(b.shape)
        assert all(s.data.shape == block for s in b.addressable_shards)
    assert placed["layers"]["wq"].addressable_shards[0].data.shape[1] < SMALL.dim


def test_an_export_is_what_safetensors_reads_in_hf_layout(tmp_path):
    c = ModelConfig(**{**vars(SMALL), "param_dtype": "bfloat16"})
    params = init_params(c, jax.random.key(4))
    hf.save(str(tmp_path), c, params)
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers asks of a file
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == hf.hf_shapes(c)
    wq = np.asarray(params["layers"]["wq"][1])  # [dim, heads, head_dim]
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert q_proj.dtype == jnp.bfloat16
    np.testing.assert_array_equal(q_proj, wq.reshape(c.dim, -1).T)
    np.testing.assert_array_equal(tensors["lm_head.weight"], np.asarray(params["lm_head"]).T)


_WRITE = textwrap.dedent("""
    import sys, jax, numpy as np
    from lclm import hf
    from lclm.config import ModelConfig
    from lclm.models.decoder import param_shapes
    c = ModelConfig(vocab_size=32000, dim=2048, n_layers=20, n_heads=32, n_kv_heads=8,
                    ffn_dim=5632, param_dtype="float32")
    # every parameter a broadcast view of one value (no memory): what is measured is the
    # export's own, and the load
    params = jax.tree.map(lambda s: np.broadcast_to(np.float32(0.01), s), param_shapes(c),
                          is_leaf=lambda x: isinstance(x, tuple))
    hf.save(sys.argv[1], c, params, max_shard_bytes=1 << 30)
    peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
    print(int(peak) * 1024)
""")

_LOAD = textwrap.dedent("""
    import sys, jax, numpy as np
    from lclm import hf
    from lclm.parallel import make_mesh
    from lclm.workdir.state import param_shardings
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
    directory = str(tmp_path / "hf")
    written = subprocess.run(
        [sys.executable, "-c", _WRITE, directory],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert written.returncode == 0, written.stderr[-3000:]
    on_disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    # one tensor on the host at a time (the largest, the embedding, is 262 MB), never one of
    # the 1 GiB files whole
    assert int(written.stdout) < 0.2 * on_disk, int(written.stdout) / 2**30
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, directory],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    params, biggest, peak = map(int, done.stdout.split())
    assert params > 1e9
    # fsdp=8: the largest block any device holds is an eighth of the largest stacked tensor
    assert biggest <= 20 * 2048 * 5632 * 4 // 8
    # on CPU the devices are host memory: the params themselves are 1x
    assert peak < 1.5 * on_disk, (peak / 2**30, on_disk / 2**30)


_KILLED = textwrap.dedent(f"""
    import os, signal, sys, jax
    import lclm.hf.weights as weights
    from lclm.config import ModelConfig
    from lclm.models.decoder import init_params
    SMALL = {SMALL!r}
    write = weights._write_file
    def killed_in_the_second_file(path, *args):
        if len(os.listdir(os.path.dirname(path))) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        write(path, *args)
    weights._write_file = killed_in_the_second_file
    weights.save(sys.argv[1], SMALL, init_params(SMALL, jax.random.key(2)),
                 max_shard_bytes=1 << 17)
""")


def test_a_failed_or_killed_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    first = init_params(SMALL, jax.random.key(1))
    hf.save(str(tmp_path), SMALL, first, max_shard_bytes=1 << 17)
    before = sorted(os.listdir(tmp_path))
    assert len(before) > 3  # several weight files, their index and config.json

    def still_whole():
        _, loaded = hf.load(str(tmp_path))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(loaded)):
            np.testing.assert_array_equal(np.asarray(a), b)

    write = hf.weights._write_file

    def disk_full_in_the_second_file(path, *args):
        if len(os.listdir(os.path.dirname(path))) == 1:
            raise OSError(28, "No space left on device")
        write(path, *args)

    monkeypatch.setattr(hf.weights, "_write_file", disk_full_in_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        hf.save(
            str(tmp_path), SMALL, init_params(SMALL, jax.random.key(2)), max_shard_bytes=1 << 17
        )
    assert sorted(os.listdir(tmp_path)) == before  # no staging directory left either
    still_whole()
    monkeypatch.undo()

    killed = subprocess.run(
        [sys.executable, "-c", _KILLED, str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [f for f in os.listdir(tmp_path) if f not in before] != []  # its staging
    still_whole()

    # a re-export into one file replaces the earlier shards entirely, and the killed one's
    # staging directory is gone
    assert hf.save(str(tmp_path), SMALL, first) == ["model.safetensors", "config.json"]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    still_whole()


_PROCESS = textwrap.dedent("""
    import sys, jax, numpy as np
    from lclm import hf
    from lclm.parallel import distributed, make_mesh
    from lclm.workdir.state import param_shardings
    distributed.initialize()
    source, out = sys.argv[1], sys.argv[2] + str(jax.process_index())
    c, whole = hf.load(source)
    _, params = hf.load(source, shardings=param_shardings(c, make_mesh(fsdp=8)))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(params)):
        assert len(b.addressable_shards) == 4
        for shard in b.addressable_shards:
            np.testing.assert_array_equal(shard.data, a[shard.index])
    hf.save(out, c, params, max_shard_bytes=1 << 17)
""")


@pytest.mark.slow
def test_two_processes_load_their_own_blocks_and_export_from_process_0(tmp_path):
    source = str(tmp_path / "source")
    hf.save(source, SMALL, init_params(SMALL, jax.random.key(5)), max_shard_bytes=1 << 17)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        ENV,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        LCLM_COORDINATOR=f"127.0.0.1:{port}",
        LCLM_NUM_PROCESSES="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS, source, str(tmp_path / "out")],
            cwd=ROOT,
            env=dict(env, LCLM_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    assert not os.path.exists(tmp_path / "out1")  # process 1 gathered, wrote nothing
    _, want = hf.load(source)
    _, got = hf.load(str(tmp_path / "out0"))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
