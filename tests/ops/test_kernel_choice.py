"""`attention.impl`: the kernel registry's limits and what 'auto' picks on each platform."""

import jax.numpy as jnp
import pytest

from lclm.ops import ring_attention
from lclm.ops.kernels import AUTO, KERNELS, choose_kernel, get_kernel
from lclm.parallel import make_mesh

LLAMA = dict(head_dim=128, q_chunk=512, kv_chunk=512, block=8192)


@pytest.fixture(autouse=True)
def _no_tokamax(monkeypatch):
    """The rules below as on a GPU machine without tokamax (its own test is separate)."""
    from lclm.ops.kernels import tokamax_gpu

    monkeypatch.setattr(tokamax_gpu, "available", lambda: False)


def test_auto_prefers_cudnn_with_tokamax_rounds_on_gpus_where_tokamax_is_installed(monkeypatch):
    from lclm.ops.kernels import tokamax_gpu

    monkeypatch.setattr(tokamax_gpu, "available", lambda: True)
    monkeypatch.setattr(tokamax_gpu, "hopper_or_newer", lambda: True)
    assert choose_kernel("auto", platform="gpu", **LLAMA) == "cudnn_gpu"
    assert choose_kernel("tokamax_gpu", platform="gpu", **LLAMA) == "tokamax_gpu"
    assert choose_kernel("auto", platform="cpu", **LLAMA) == "blockwise"
    # its kernels compute in bf16/f16 and need sm90+: elsewhere auto falls back
    assert choose_kernel("auto", platform="gpu", dtype="float32", **LLAMA) == "pallas_gpu"
    monkeypatch.setattr(tokamax_gpu, "hopper_or_newer", lambda: False)  # e.g. an A100
    assert choose_kernel("auto", platform="gpu", **LLAMA) == "pallas_gpu"


@pytest.mark.parametrize(
    "head_dim,want", [(64, "cudnn_gpu"), (128, "cudnn_gpu"), (256, "pallas_gpu"), (96, "blockwise")]
)
def test_tokamax_serves_only_the_head_dims_checked_on_a_gpu(monkeypatch, head_dim, want):
    from lclm.ops.kernels import tokamax_gpu

    monkeypatch.setattr(tokamax_gpu, "available", lambda: True)
    monkeypatch.setattr(tokamax_gpu, "hopper_or_newer", lambda: True)
    shapes = dict(LLAMA, head_dim=head_dim)
    assert choose_kernel("auto", platform="gpu", **shapes) == want
    why = get_kernel("tokamax_gpu").limits(platform="gpu", **shapes)
    assert (why is None) == (want == "cudnn_gpu")
    if why is not None:
        assert f"head dim {head_dim} must be 64 or 128" in why


@pytest.mark.parametrize(
    "platform,shapes,want",
    [
        ("cpu", LLAMA, "blockwise"),  # fused kernels only interpret here
        ("gpu", LLAMA, "pallas_gpu"),
        ("cuda", dict(LLAMA, head_dim=64), "pallas_gpu"),
        ("gpu", dict(LLAMA, head_dim=96), "blockwise"),  # Triton: power-of-two head dims
        ("gpu", dict(LLAMA, q_chunk=8, kv_chunk=8), "blockwise"),  # Triton tiles are >= 16
        ("tpu", LLAMA, "pallas_tpu"),
        ("tpu", dict(LLAMA, q_chunk=64), "pallas_tpu"),  # its tiles are its own on a TPU
        ("tpu", dict(LLAMA, block=1088), "blockwise"),  # no 128-multiple tile divides it
        ("tpu", dict(LLAMA, q_chunk=64, kv_chunk=64, block=64), "pallas_tpu"),  # one whole tile
    ],
)
def test_auto_picks_the_fastest_kernel_that_can_serve(platform, shapes, want):
    assert choose_kernel("auto", platform=platform, **shapes) == want


@pytest.mark.parametrize(
    "impl,platform,shapes,needle",
    [
        ("pallas_tpu", "gpu", LLAMA, "runs on TPUs"),
        ("pallas_gpu", "tpu", LLAMA, "runs on GPUs"),
        ("pallas_gpu", "gpu", dict(LLAMA, head_dim=96), "head dim 96 must be a power of two"),
        ("pallas_tpu", "tpu", dict(LLAMA, block=1088), "block of 1088 tokens must be a multiple"),
        ("tokamax_gpu", "gpu", LLAMA, "tokamax is not installed"),
        ("tokamax_gpu", "cpu", LLAMA, "GPUs only"),
        ("tokamax_gpu", "gpu", dict(LLAMA, head_dim=256), "head dim 256 must be 64 or 128"),
    ],
)
def test_an_explicit_kernel_that_cannot_serve_fails_in_one_line(impl, platform, shapes, needle):
    with pytest.raises(ValueError) as e:
        choose_kernel(impl, platform=platform, **shapes)
    assert needle in str(e.value) and "'auto'" in str(e.value) and "\n" not in str(e.value)


def test_every_auto_kernel_is_registered_and_imports_here():
    from lclm.ops.kernels import tokamax_gpu

    for names in AUTO.values():
        assert names[-1] == "blockwise"  # auto always has a kernel that serves any shape
        for name in names:
            why = get_kernel(name).limits(platform=None, **LLAMA)
            optional = name in ("cudnn_gpu", "tokamax_gpu") and not tokamax_gpu.available()
            assert name in KERNELS and (why is None or optional and "not installed" in why)
            get_kernel(name)  # GPU/TPU kernel code imports cleanly on a CPU machine


def test_ring_refuses_a_kernel_that_cannot_serve_before_tracing_it():
    q = jnp.zeros((2, 32, 2, 24))  # head dim 24: no fused kernel
    with pytest.raises(ValueError, match="head dim 24 must be a power of two"):
        ring_attention(q, q, q, mesh=make_mesh(sp=2), impl="pallas_gpu", q_chunk=8, kv_chunk=8)


def test_the_trainer_names_its_kernel_and_refuses_one_the_platform_cannot_run():
    from lclm.config import AttentionConfig, ModelConfig, base_config
    from lclm.errors import ConfigError
    from lclm.train.startup_checks import attention_kernel

    kernel = lambda c, model, sp, platform: attention_kernel(
        AttentionConfig.from_config(c.attention), c.data.seq_len, model, sp, platform
    )

    c = base_config()
    c.model.update(dim=512, n_heads=4, n_kv_heads=4)  # head dim 128
    c.data.seq_len, c.attention.q_chunk, c.attention.kv_chunk = 8192, 64, 64
    model = ModelConfig.from_config(c.model)
    assert kernel(c, model, 4, "cpu") == "blockwise"
    assert kernel(c, model, 4, "cuda") == "pallas_gpu"
    assert kernel(c, model, 4, "tpu") == "pallas_tpu"  # it sizes its own tiles
    c.data.seq_len = 4 * 1088  # local blocks of 1088 tokens: no 128-multiple tile divides them
    assert kernel(c, model, 4, "tpu") == "blockwise"
    c.attention.impl = "pallas_tpu"
    with pytest.raises(ConfigError, match="block of 1088 tokens must be a multiple of 128"):
        kernel(c, model, 4, "tpu")
