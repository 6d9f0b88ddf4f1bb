"""bfloat16 compute, float32 parameters: the gradients of weights used by every sequence chunk
(the blockwise feed-forward's, the output projection's, tied or not) are summed over the chunks
in float32, so their error against a float32 reference does not grow with the chunk count."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lclm.config import AttentionConfig, ModelConfig
from lclm.models.decoder import init_params, loss_terms
from lclm.ops.ffn import blockwise_ffn
from lclm.ops.loss import blockwise_cross_entropy

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'

BF16, F32 = jnp.bfloat16, jnp.float32
CHUNKS = 64  # compared with a single chunk over the same sequence
GROWTH = 1.5  # the bfloat16 running sum grew these errors 1.6x-5.6x at 64 chunks


def _err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _assert_no_growth(errors, name):
    one, many = errors[1], errors[CHUNKS]
    assert many <= GROWTH * one + 1e-6, f"{name}: error {one:.3e} (1 chunk) -> {many:.3e}"


def _ffn_case(seed=0, t=1024, d=64, f=128):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((1, t, d)), BF16)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.1, F32) for s in ((d, f), (d, f), (f, d))]
    r = jnp.asarray(rng.standard_normal((1, t, d)), F32)  # a dense output cotangent
    return x, ws, r


@pytest.mark.parametrize("cast_by", ["caller", "op"])
def test_ffn_weight_grads_do_not_degrade_with_more_chunks(cast_by):
    """`caller`: bf16 weights passed in (gradient taken at their f32 originals), as
    decoder.layer_with_kv does; `op`: f32 weights and `dtype=bfloat16`."""
    x, ws, r = _ffn_case()
    t = x.shape[1]

    def loss(ws, x, chunk, dtype):
        if cast_by == "caller":
            y = blockwise_ffn(x.astype(dtype), *(w.astype(dtype) for w in ws), chunk=chunk)
        else:
            y = blockwise_ffn(x.astype(dtype), *ws, chunk=chunk, dtype=dtype)
        return jnp.sum(y.astype(F32) * r)

    grad = jax.jit(jax.grad(loss), static_argnums=(2, 3))
    ref = grad(ws, x.astype(F32), t, F32)
    errors = {n: [_err(g, w) for g, w in zip(grad(ws, x, t // n, BF16), ref)] for n in (1, CHUNKS)}
    for i, name in enumerate(("w_gate", "w_up", "w_down")):
        _assert_no_growth({n: e[i] for n, e in errors.items()}, name)


@pytest.mark.parametrize("cast_by", ["caller", "op"])
def test_output_weight_grad_does_not_degrade_with_more_chunks(cast_by):
    rng = np.random.default_rng(1)
    t, d, v = 1024, 64, 256
    h = jnp.asarray(rng.standard_normal((1, t, d)), BF16)
    w = jnp.asarray(rng.standard_normal((d, v)) * 0.1, F32)
    targets = jnp.asarray(rng.integers(0, v, (1, t)), jnp.int32)
    mask = jnp.asarray(rng.random((1, t)) < 0.8, F32)

    def loss(w, h, chunk, dtype):
        if cast_by == "caller":
            out = blockwise_cross_entropy(
                h.astype(dtype), w.astype(dtype), targets, mask, chunk=chunk
            )
        else:
            out = blockwise_cross_entropy(
                h.astype(dtype), w, targets, mask, chunk=chunk, dtype=dtype
            )
        return out[0]

    grad = jax.jit(jax.grad(loss), static_argnums=(2, 3))
    ref = grad(w, h.astype(F32), t, F32)
    _assert_no_growth({n: _err(grad(w, h, t // n, BF16), ref) for n in (1, CHUNKS)}, "w_out")


def _batch(rng, b, t, vocab, input_vocab):
    """Inputs only from the first `input_vocab` ids: the other embedding rows of a tied model
    receive nothing but the output projection's gradient."""
    return dict(
        tokens=rng.integers(0, input_vocab, (b, t)).astype(np.int32),
        targets=rng.integers(0, vocab, (b, t)).astype(np.int32),
        loss_mask=(rng.random((b, t)) < 0.9).astype(np.float32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        segment_ids=np.ones((b, t), np.int32),
    )


def _model_errors(grads, ref, tie, input_vocab):
    head = (
        (grads["embed"][input_vocab:], ref["embed"][input_vocab:])
        if tie
        else (grads["lm_head"], ref["lm_head"])
    )
    out = {"output projection": _err(*head)}
    for name in ("w_gate", "w_up", "w_down"):
        out[name] = _err(grads["layers"][name], ref["layers"][name])
    return out


def test_tied_model_grads_do_not_degrade_with_more_chunks():
    """loss_terms of a tied model (the untied output projection: the train step test below)."""
    tie, t, input_vocab = True, 256, 128
    base = dict(tie_embeddings=tie, n_layers=1, init_std=0.05)
    params = init_params(ModelConfig(**base), jax.random.key(1))
    batch = _batch(np.random.default_rng(2), 1, t, 512, input_vocab)
    attention = AttentionConfig(q_chunk=64, kv_chunk=64)

    def grads(dtype, chunk):
        c = ModelConfig(**base, dtype=dtype, ffn_chunk=chunk, loss_chunk=chunk)
        f = lambda p: loss_terms(c, p, batch, attention=attention)[0]
        return jax.jit(jax.grad(f))(params)

    ref = grads("float32", t)
    errors = {
        n: _model_errors(grads("bfloat16", t // n), ref, tie, input_vocab) for n in (1, CHUNKS)
    }
    for name in errors[1]:
        _assert_no_growth({n: e[name] for n, e in errors.items()}, name)


def test_train_step_grads_with_accumulation_do_not_degrade_with_more_chunks():
    """The whole step of an untied model (grad_accum=2 on an fsdp=2 x sp=2 mesh): sgd with
    learning rate -1 turns the update into the step's gradient."""
    from lclm.data.loader import batch_sharding
    from lclm.ops.layout import batch_to_layout
    from lclm.parallel import make_mesh
    from lclm.train.step import make_train_step
    from lclm.workdir.state import init_state

    mesh, sp, t, input_vocab = make_mesh(fsdp=2, sp=2), 2, 512, 128
    train = types.SimpleNamespace(
        grad_accum=2, lr=1.0, warmup=1, steps=1, min_lr_ratio=1.0, decay="cosine"
    )
    optimizer = optax.sgd(lambda count: -1.0)
    batch = batch_to_layout(_batch(np.random.default_rng(3), 4, t, 512, input_vocab), "striped", sp)
    batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}

    def grads(dtype, chunk):
        model = ModelConfig(
            n_layers=1, init_std=0.05, dtype=dtype, ffn_chunk=chunk, loss_chunk=chunk
        )
        state = init_state(model, optimizer, mesh, seed=4)
        step = jax.jit(
            make_train_step(model, AttentionConfig(q_chunk=64, kv_chunk=64), train, mesh, optimizer)
        )
        new, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0
        return jax.tree.map(
            lambda a, b: np.asarray(a) - np.asarray(b),
            jax.device_get(new.params),
            jax.device_get(state.params),
        )

    local = t // sp
    ref = grads("float32", local)
    errors = {
        n: _model_errors(grads("bfloat16", local // n), ref, False, input_vocab)
        for n in (1, CHUNKS)
    }
    for name in errors[1]:
        _assert_no_growth({n: e[name] for n, e in errors.items()}, name)


def _scan_carries(jaxpr):
    """Avals of the outputs of every scan in a (closed) jaxpr, nested ones included: the
    final carries, and the stacked per-step outputs (which have a leading length axis, so a
    weight-shaped output is a carry). Read from the outputs because scan's parameters that
    say which inputs are carries differ between jax versions."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out += [v.aval for v in eqn.outvars]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    out += _scan_carries(sub)
    return out


def test_backward_accumulates_weight_grads_in_float32():
    """The jaxpr of the bf16 backward: a scan carry shaped like a weight is float32."""
    x, ws, r = _ffn_case(t=64, d=8, f=12)
    h, w_out = x, jnp.ones((8, 16), F32)
    targets, mask = jnp.zeros((1, 64), jnp.int32), jnp.ones((1, 64), F32)
    ffn = lambda ws: jnp.sum(
        blockwise_ffn(x, *(w.astype(BF16) for w in ws), chunk=8).astype(F32) * r
    )
    ce = lambda w: blockwise_cross_entropy(h, w.astype(BF16), targets, mask, chunk=8)[0]
    for f, args, shapes in ((ffn, ws, {(8, 12), (12, 8)}), (ce, w_out, {(8, 16)})):
        carries = [
            a for a in _scan_carries(jax.make_jaxpr(jax.grad(f))(args)) if tuple(a.shape) in shapes
        ]
        assert carries and all(a.dtype == F32 for a in carries), carries
