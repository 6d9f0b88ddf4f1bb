"""The fused GPU kernel (Pallas, interpret mode on CPU) against the dense float32 reference.

Block-pair level: forward (o, lse) and backward from the *global* o/lse, for the masks the
ring produces (causal, strictly causal striped rounds, full, segments), GQA/MQA and the LLaMA
head dims. The ring-level tests in tests/ops/test_ring_attention.py run the same kernel over
meshes.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops.kernels.blockwise import backward as blockwise_backward
from lclm.ops.kernels.blockwise import forward as blockwise_forward
from lclm.ops.kernels.pallas_gpu import backward, forward
from lclm.ops.kernels.reference import dense_attention


def _dense_block(q, k, v, q_pos, k_pos, q_seg, k_seg, causal):
    """Reference attention of one block pair with explicit positions: (o, lse), float32."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = jnp.ones(s.shape, bool)
    if causal:
        mask = mask & (q_pos[:, None] >= k_pos[None, :])
    if q_seg is not None:
        mask = mask & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), jnp.swapaxes(lse, 1, 2)


def _case(seed, b=2, t=64, h=4, hkv=2, d=16, segments=False, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d), np.float32)
    k = rng.standard_normal((b, t, hkv, d), np.float32)
    v = rng.standard_normal((b, t, hkv, d), np.float32)
    do = rng.standard_normal((b, t, h, d), np.float32)
    seg = np.cumsum(rng.random((b, t)) < 0.1, axis=1).astype(np.int32) if segments else None
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), cast(do), seg


def _rel(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12)


# (q positions, k positions): one device's block in striped round k <= j (causal), k > j
# (strictly causal: the first query sees nothing), and a contiguous earlier block (full view)
POSITIONS = {
    "causal": lambda t: (np.arange(t) * 4 + 2, np.arange(t) * 4 + 1),
    "strict": lambda t: (np.arange(t) * 4 + 1, np.arange(t) * 4 + 2),
    "earlier": lambda t: (np.arange(t) + t, np.arange(t)),
}


@pytest.mark.parametrize(
    "positions,causal,hkv,d,segments",
    [
        ("causal", True, 2, 16, False),
        ("strict", True, 1, 64, True),
        ("earlier", True, 4, 16, True),
        ("causal", False, 2, 128, False),
    ],
)
def test_block_pair_matches_dense(positions, causal, hkv, d, segments):
    q, k, v, do, seg = _case(
        zlib.crc32(repr((positions, causal, hkv, d)).encode()), hkv=hkv, d=d, segments=segments
    )
    q_pos, k_pos = (jnp.asarray(p, jnp.int32) for p in POSITIONS[positions](q.shape[1]))
    kw = dict(causal=causal, q_chunk=16, kv_chunk=32)
    o, lse = forward(q, k, v, q_pos, k_pos, seg, seg, **kw)
    want_o, want_lse = _dense_block(q, k, v, q_pos, k_pos, seg, seg, causal)
    assert _rel(o, want_o) < 1e-5
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=1e-5)
    if positions == "strict":
        assert not finite[:, 0].any() and not np.asarray(o)[:, 0].any()  # sees nothing: o=0

    # backward from this block's own o/lse equals the dense VJP of the block
    got = backward(q, k, v, o, lse, do, q_pos, k_pos, seg, seg, **kw)
    _, vjp = jax.vjp(
        lambda q, k, v: _dense_block(q, k, v, q_pos, k_pos, seg, seg, causal)[0], q, k, v
    )
    for g, w in zip(got, vjp(do)):
        assert np.isfinite(np.asarray(g)).all()
        assert _rel(g, w) < 1e-5


def test_backward_with_global_statistics_matches_blockwise_kernel():
    """Ring usage: o/lse come from all rounds, not this block; gradients must still agree."""
    q, k, v, do, seg = _case(7, segments=True)
    t = q.shape[1]
    q_pos, k_pos = jnp.arange(t) * 2 + 1, jnp.arange(t) * 2  # one of two striped rounds
    o, lse = dense_attention(q, k, v), jax.random.normal(jax.random.key(0), (2, t, 4)) + 3.0
    kw = dict(causal=True, q_chunk=16, kv_chunk=16)
    got = backward(q, k, v, o, lse, do, q_pos, k_pos, seg, seg, **kw)
    want = blockwise_backward(q, k, v, o, lse, do, q_pos, k_pos, seg, seg, **kw)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5


def test_bf16_inputs_float32_results():
    q, k, v, do, _ = _case(11, t=128, d=64, dtype=jnp.bfloat16)
    pos = jnp.arange(128)
    kw = dict(causal=True, q_chunk=32, kv_chunk=32)
    o, lse = forward(q, k, v, pos, pos, None, None, **kw)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    want_o, want_lse = blockwise_forward(q, k, v, pos, pos, None, None, **kw)
    assert _rel(o, want_o) < 1e-2 and _rel(lse, want_lse) < 1e-2
    grads = backward(q, k, v, o, lse, do, pos, pos, None, None, **kw)
    wants = blockwise_backward(q, k, v, want_o, want_lse, do, pos, pos, None, None, **kw)
    for g, w in zip(grads, wants):
        assert g.dtype == jnp.float32 and _rel(g, w) < 2e-2


def test_hidden_tiles_are_skipped_in_both_passes():
    """K/V tiles that no query may see are poisoned with NaN: computing them and masking
    afterwards would give NaN (0 * NaN) in o, dq, and in their own dk/dv; skipping keeps
    everything finite and dk/dv of those keys exactly 0."""
    q, k, v, do, _ = _case(13)
    t = q.shape[1]
    q_pos, k_pos = jnp.arange(t), jnp.arange(t) + t // 2  # keys of the 2nd half: hidden
    hidden = np.asarray(k_pos) > t - 1
    poison = lambda x: jnp.where(jnp.asarray(hidden)[None, :, None, None], jnp.nan, x)
    k, v = poison(k), poison(v)
    kw = dict(causal=True, q_chunk=16, kv_chunk=16)
    o, lse = forward(q, k, v, q_pos, k_pos, None, None, **kw)
    assert np.isfinite(np.asarray(o)).all()
    dq, dk, dv = backward(q, k, v, o, lse, do, q_pos, k_pos, None, None, **kw)
    assert np.isfinite(np.asarray(dq)).all()
    assert not np.asarray(dk)[:, hidden].any() and not np.asarray(dv)[:, hidden].any()
    clean = slice(0, t // 2)
    want_o, _ = _dense_block(q, k[:, clean], v[:, clean], q_pos, k_pos[clean], None, None, True)
    assert _rel(o, want_o) < 1e-5


def test_tiles_must_be_powers_of_two():
    q, k, v, _, _ = _case(1, t=48)
    pos = jnp.arange(48)
    with pytest.raises(ValueError, match="power of two"):
        forward(q, k, v, pos, pos, None, None, causal=True, q_chunk=48, kv_chunk=16)


@pytest.mark.parametrize("d,segments", [(128, True), (64, False)])
def test_kernels_lower_to_triton_for_gpus(d, segments):
    """Without a GPU, export for CUDA: Pallas lowers all three kernels to Triton IR, which
    checks what Triton needs (power-of-two tensor sizes, supported ops, the cond/loop
    structure). Triton's own compilation to PTX happens only on a GPU."""
    b, t, h, hkv = 1, 256, 4, 2
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((t,), jnp.int32)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32) if segments else None

    def both_passes(q, k, v, do, pos, *seg):
        seg = seg[0] if seg else None
        kw = dict(causal=True, q_chunk=128, kv_chunk=64, platform="gpu")  # as for a GPU mesh
        o, lse = forward(q, k, v, pos, pos, seg, seg, **kw)
        return backward(q, k, v, o, lse, do, pos, pos, seg, seg, **kw)

    triton = "__gpu$xla.gpu.triton"
    export = jax.export.export(
        jax.jit(both_passes),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)],
    )
    args = (x, kv, kv, x, pos, *([seg] if segments else []))
    if hasattr(jax.sharding, "AbstractDevice"):  # jax >= 0.12 asks for the GPU generation
        target = jax.sharding.AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda"
        )
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=target)
        with jax.sharding.use_abstract_mesh(mesh):
            exported = export(*args)
    else:
        try:
            exported = export(*args)
        except Exception as e:  # a jax that asks the device for its GPU generation
            if "No supported GPU devices" in str(e):
                pytest.skip(
                    f"this jax ({jax.__version__}) lowers Triton only with a GPU "
                    "present and has no AbstractDevice to name one"
                )
            raise
    module = exported.mlir_module()
    for name in ("lclm_flash_forward", "lclm_flash_backward_dkdv", "lclm_flash_backward_dq"):
        assert f'name = "{name}"' in module
    assert module.count(f"custom_call @{triton}") == 3
    # tiles are skipped inside the kernels: no branch or loop runs per tile on the host side
    assert "stablehlo.case" not in module and "stablehlo.if" not in module
    assert "stablehlo.while" not in module
