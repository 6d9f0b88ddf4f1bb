"""Greedy decoding with the ring prefill and KV cache against full forward recomputation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.config import AttentionConfig, ModelConfig
from lclm.eval.decode import greedy_generate, last_layout_index, pad_front, prefill
from lclm.families import FAMILIES
from lclm.models.decoder import forward, init_params
from lclm.ops.layout import batch_to_layout
from lclm.parallel import make_mesh
from lclm.workdir.state import shard_params

# large init so that greedy choices are far from ties; GQA (4 heads over 2 kv heads)
MODEL = ModelConfig(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    dtype="float32",
    init_std=0.5,
    remat="none",
    ffn_chunk=8,
    loss_chunk=8,
)
ATTENTION = AttentionConfig(layout="striped", q_chunk=8, kv_chunk=8)
P, M = 64, 5


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of different lengths, front-padded into `[3, P]` rows."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 64, n).astype(np.int32) for n in (P, P - 5, P - 17)]
    return docs, pad_front(docs, P, pad_id=0)


# the reference runs one sequence length, so every chunk size divides it
FULL = dataclasses.replace(MODEL, ffn_chunk=4096)


def recompute_greedy(params, docs, steps, model=MODEL):
    """Reference: re-run the whole model (no cache) on every row's growing sequence for
    every new token. Rows are right-padded to one length: causal attention never looks
    ahead, so the padding does not change the logits read at each row's last token."""
    full = dataclasses.replace(model, ffn_chunk=4096)
    full_forward = jax.jit(lambda prm, tokens: forward(full, prm, tokens))
    seqs = [list(d) for d in docs]
    for _ in range(steps):
        width = max(map(len, seqs)) + steps
        tokens = np.zeros((len(seqs), width), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = s
        logits = full_forward(params, jnp.asarray(tokens))
        for r, s in enumerate(seqs):
            s.append(int(jnp.argmax(logits[r, len(s) - 1])))
    return [s[len(d) :] for s, d in zip(seqs, docs)]


def test_cached_greedy_decode_equals_full_forward_argmax(params, prompts):
    docs, rows = prompts
    out = greedy_generate(MODEL, ATTENTION, params, *rows, M)
    assert out.shape == (3, M)
    assert out.tolist() == recompute_greedy(params, docs, M)


def test_ring_prefill_on_striped_sp4_matches_forward(params, prompts):
    docs, (tokens, positions, segments) = prompts
    mesh = make_mesh(fsdp=1, sp=4)
    sharded = shard_params(MODEL, params, mesh)
    batch = batch_to_layout(dict(t=tokens, p=positions, s=segments), "striped", 4)
    last = last_layout_index("striped", 4, P)
    run = jax.jit(
        lambda prm, t, p, s: prefill(
            MODEL, ATTENTION, prm, t, p, s, last=last, max_new=M, mesh=mesh
        )
    )
    logits, cache = run(sharded, batch["t"], batch["p"], batch["s"])
    for r, doc in enumerate(docs):
        want = forward(FULL, params, jnp.asarray(doc[None]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[r]), np.asarray(want), rtol=1e-4, atol=1e-4)
    # the cache is in striped order and its padding is hidden from decoded tokens
    assert cache.k.shape == (MODEL.n_layers, 3, P, MODEL.n_kv_heads, MODEL.head_dim)
    assert np.array_equal(np.asarray(cache.visible), batch["s"] == 1)


def test_greedy_decode_on_a_mesh_matches_one_device(params, prompts):
    _, rows = prompts
    rows = tuple(np.concatenate([r, r[:1]]) for r in rows)  # 4 rows for fsdp=2
    mesh = make_mesh(fsdp=2, sp=4)
    on_mesh = greedy_generate(
        MODEL, ATTENTION, shard_params(MODEL, params, mesh), *rows, M, mesh=mesh
    )
    assert np.array_equal(on_mesh, greedy_generate(MODEL, ATTENTION, params, *rows, M))


@pytest.mark.parametrize(
    "family", [name for name, f in FAMILIES.items() if f.qkv_bias or f.qk_norm]
)
def test_cached_decoding_runs_each_familys_layer(family, prompts):
    """The cached decode step runs the layer training runs (`decoder_layer`): each registered
    family's layer options (Qwen2's q/k/v biases, Qwen3's q/k norms), with a head_dim apart
    from dim / heads, give the greedy tokens of recomputing the whole model."""
    model = dataclasses.replace(MODEL, family=family, head_dim=12)
    params = init_params(model, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 8))
    for name in ("bq", "bk", "bv", "q_norm", "k_norm"):  # not zeros and ones: they count
        if name in params["layers"]:
            w = params["layers"][name]
            params["layers"][name] = w + 0.5 * jax.random.normal(next(keys), w.shape)
    docs, rows = prompts
    assert greedy_generate(model, ATTENTION, params, *rows, M).tolist() == recompute_greedy(
        params, docs, M, model
    )


def test_decoding_stops_each_row_at_its_stop_token_and_ends_when_all_have(params, prompts):
    """A row ends at its first stop id (later columns repeat it) and the loop ends once every
    row has: fewer steps than max_new, the same tokens up to each row's stop."""
    _, rows = prompts
    full = greedy_generate(MODEL, ATTENTION, params, *rows, 12)
    stops = tuple(int(t) for t in full[:, 2])  # every row meets one by its third token
    stopped = greedy_generate(MODEL, ATTENTION, params, *rows, 12, stop_ids=stops)
    ends = [int(np.flatnonzero(np.isin(r, stops))[0]) for r in full]
    assert stopped.shape == (3, max(ends) + 1) and stopped.shape[1] <= 3 < 12
    for r, end in enumerate(ends):
        assert stopped[r, : end + 1].tolist() == full[r, : end + 1].tolist()
        assert (stopped[r, end:] == full[r, end]).all()


def test_generate_stops_at_eos(params):
    """`lclm.eval generate`'s continuation ends at the tokenizer's EOS (here: the token the
    model decodes third) instead of running on to max_new."""
    from types import SimpleNamespace

    from lclm.eval.generate import continuation
    from lclm.eval.model import LoadedModel

    mesh = make_mesh(fsdp=1, sp=1)
    prompt = list(range(3, 40))
    model = LoadedModel(
        MODEL,
        ATTENTION,
        shard_params(MODEL, params, mesh),
        mesh,
        SimpleNamespace(eos_id=None),
        "test",
    )
    full = continuation(model, prompt, 12)
    assert len(full) == 12
    eos = int(full[2])
    first = full.tolist().index(eos)
    model.tokenizer = SimpleNamespace(eos_id=eos)
    out = continuation(model, prompt, 12)
    assert out.tolist() == full[: first + 1].tolist() and out[-1] == eos
