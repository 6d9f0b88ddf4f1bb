"""Every registered context-parallel strategy (`lclm.ops.context_parallel.STRATEGIES`) and every
registered kernel (`lclm.ops.kernels.KERNELS`) against the dense float32 reference, values
and gradients: registering one runs it here, with packed documents, GQA and MQA, every
layout and meshes of sp 2-8 with tp, fsdp and dp (all four axes above 1 on 16 simulated
devices, in a process of its own). Each strategy gets the Ulysses degree its own `limits`
allow (usp: 2), each kernel the shapes its own `limits` allow on this host (one that cannot
run here, as tokamax_gpu off a Hopper GPU, is skipped with its reason)."""

import json
import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import pytest
from support import ROOT
from test_ring_attention import _close, _inputs, _reference

from lclm.config import AttentionConfig
from lclm.ops.context_parallel import STRATEGIES, context_parallel_attention, strategy_of
from lclm.ops.kernels import KERNELS, get_kernel
from lclm.ops.layout import from_layout, to_layout
from lclm.parallel import make_mesh


def _with_degree(strategy: str, ulysses: int):
    """`strategy` holding Ulysses degree `ulysses` where that is an option of its own (usp)."""
    own = "ulysses" in STRATEGIES[strategy].options
    return strategy_of(AttentionConfig(strategy=strategy, ulysses=ulysses if own else 1))


def _degree(strategy: str, heads: int, tp: int, sp: int) -> int:
    """The Ulysses degree to test `strategy` at: 2 where its limits take it, else 1."""
    return next(
        u for u in (2, 1) if _with_degree(strategy, u).limits(heads=heads, tp=tp, sp=sp) is None
    )


def check(
    strategy, layout, mesh_kw, h, hkv, segments, impl="blockwise", chunk=8, batch=2, ulysses=None
):
    """o, dq, dk, dv of `strategy` on a mesh of `mesh_kw` against the dense reference
    (`ulysses`: usp's degree; None: the one `_degree` picks)."""
    q, k, v, do, seg = _inputs(
        zlib.crc32(repr((strategy, layout, h, hkv)).encode()),
        b=batch,
        h=h,
        hkv=hkv,
        segments=segments,
    )
    want = _reference(q, k, v, do, seg)
    mesh = make_mesh(**mesh_kw)
    sizes = dict(mesh.shape)
    if ulysses is None:
        ulysses = _degree(strategy, h, sizes["tp"], sizes["sp"])
    # the layout's shards: the ring's members (usp: sp / ulysses, each cut over its group)
    chosen = _with_degree(strategy, ulysses)
    n = chosen.layout_shards(sizes["sp"])
    lay = lambda x: None if x is None else to_layout(jnp.asarray(x), layout, n)

    def f(q, k, v):
        return context_parallel_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy=chosen,
            layout=layout,
            segment_ids=lay(seg),
            q_chunk=chunk,
            kv_chunk=chunk,
            impl=impl,
        )

    out, vjp = jax.vjp(jax.jit(f), lay(q), lay(k), lay(v))
    for got, w in zip((out, *vjp(lay(do))), want):  # o, dq, dk, dv
        _close(from_layout(got, layout, n), w)


# (layout, mesh, query heads, K/V heads, packed documents): GQA and MQA (Ulysses replicates
# K/V heads x2, x8, x2 after tp), every layout, sp 2-8 beside tp and fsdp
CASES = [
    ("striped", dict(sp=4), 4, 2, True),
    ("zigzag", dict(sp=8), 8, 1, True),
    ("contiguous", dict(tp=2, sp=2), 8, 2, False),
    ("zigzag", dict(fsdp=2, sp=4), 4, 4, True),
    ("striped", dict(fsdp=2, tp=2, sp=2), 8, 2, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}/{c[3]}")
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_matches_dense(strategy, case):
    check(strategy, *case)


def _host_shapes(name: str):
    """(head dim, chunk) a kernel serves on this host for the sequences below, or the reason
    it serves none."""
    why = None
    for head_dim, chunk in ((16, 16), (64, 16)):
        why = get_kernel(name).limits(
            head_dim=head_dim,
            q_chunk=chunk,
            kv_chunk=chunk,
            block=16,
            platform=jax.devices()[0].platform,
            dtype="float32",
        )
        if why is None:
            return head_dim, chunk
    return why


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "blockwise"])
def test_every_kernel_under_every_strategy(kernel, strategy):
    """The fused kernels (interpreted on CPU: same kernel code, CPU semantics) under each
    strategy; blockwise runs every case above."""
    shapes = _host_shapes(kernel)
    if isinstance(shapes, str):
        pytest.skip(f"{kernel}: {shapes}")
    check(strategy, "striped", dict(sp=4), 4, 2, True, impl=kernel, chunk=shapes[1], batch=1)


_FOUR_AXES = """
import json, sys
sys.path[:0] = [{tests!r}, {ops!r}]
import conftest  # noqa: F401  (the suite's device and precision settings)
from test_strategies import STRATEGIES, check
failed = {{}}
for strategy in STRATEGIES:
    try:
        check(strategy, "zigzag", dict(dp=2, fsdp=2, tp=2, sp=2), 8, 2, True, batch=4)
    except AssertionError as e:
        failed[strategy] = str(e)
print(json.dumps(failed))
"""


def test_every_strategy_on_a_mesh_of_all_four_axes():
    """dp, fsdp, tp and sp all 2: 16 devices, more than the suite's 8, so in a process of its
    own (its conftest import sets the rest of the suite's environment)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16")
    env.pop("NPROC", None)  # sized for the suite's 8 devices; conftest sizes it for 16
    tests = os.path.join(ROOT, "tests")
    code = _FOUR_AXES.format(tests=tests, ops=os.path.join(tests, "ops"))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_limits_refuse_at_start_what_the_attention_refuses(strategy):
    """Start-up validation asks `Strategy.limits`: whatever the attention itself refuses (a
    ValueError while tracing: shapes only, nothing compiled) limits must refuse first, and
    they must allow some of these shapes (a strategy whose limits refuse everything would
    pass the first check)."""
    allowed = 0
    for heads, kv_heads, tp, sp, ulysses in [
        (4, 2, 1, 8, 1),
        (8, 2, 1, 8, 1),
        (4, 2, 2, 4, 1),
        (4, 1, 1, 8, 2),
        (4, 2, 1, 8, 4),
        (8, 1, 1, 8, 8),
        (4, 2, 1, 8, 3),
        (6, 2, 2, 2, 2),
        (4, 1, 1, 4, 1),
    ]:
        mesh = make_mesh(tp=tp, sp=sp)
        q = jax.ShapeDtypeStruct((2, 8 * sp, heads, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((2, 8 * sp, kv_heads, 16), jnp.float32)
        chosen = _with_degree(strategy, ulysses)
        why = chosen.limits(heads=heads, tp=tp, sp=sp)
        allowed += why is None
        try:
            jax.eval_shape(
                lambda q, k, v, mesh=mesh, s=chosen: context_parallel_attention(
                    q,
                    k,
                    v,
                    mesh=mesh,
                    strategy=s,
                    q_chunk=8,
                    kv_chunk=8,
                    impl="blockwise",
                    layout="contiguous",
                ),
                q,
                kv,
                kv,
            )
        except ValueError as e:
            assert why is not None, (heads, kv_heads, tp, sp, ulysses, str(e))
    assert allowed >= 2
