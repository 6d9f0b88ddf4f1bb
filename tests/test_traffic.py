"""`lclm.plan.traffic`: the bytes a compiled program moves, on programs XLA compiled here
(XLA:CPU's optimized HLO has the same text form as XLA:GPU's) and on hand-written HLO for
what a CPU compile does not produce (asynchronous fusions, conditionals)."""
# ruff: noqa: E501  (HLO's instructions are one line each, as XLA prints them)

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lclm.plan.traffic import shape_bytes, traffic


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_shapes_count_their_elements_and_tuples_their_parts():
    assert shape_bytes("f32[8,128]{1,0}") == 8 * 128 * 4
    assert shape_bytes("bf16[3]{0}") == 6
    assert shape_bytes("(s32[], f32[2,2]{1,0}, pred[5]{0})") == 4 + 16 + 5
    assert shape_bytes("f8e4m3fn[10]{0}") == 10


def test_one_elementwise_kernel_reads_its_input_and_writes_its_output():
    x = jnp.ones((256, 1024), jnp.float32)
    moved = traffic(_compiled_text(lambda x: jnp.sin(x) * 2.0, x))
    assert moved.bytes == 2 * x.nbytes and moved.unknown_loops == 0


def test_a_loop_counts_each_trip_and_slices_not_the_stacked_buffer():
    """A scan over 16 layers' weights: each trip reads one layer's slice (not all 16) and the
    carry, and writes the carry; XLA records the trip count, so the walk multiplies by it."""
    layers, n = 16, 512
    w = jnp.ones((layers, n, n), jnp.float32)
    x = jnp.ones((8, n), jnp.float32)

    def f(x, w):
        return lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    moved = traffic(_compiled_text(f, x, w))
    assert moved.unknown_loops == 0
    # each layer's slice is read, written as its own array and read by the matmul: about 3x
    # the stack, where counting the whole stacked buffer at every trip would give 16x
    assert 2 * w.nbytes <= moved.bytes < 4 * w.nbytes


HAND_WRITTEN = """HloModule m, is_scheduled=true

%fused_slice (param_0: f32[16,1024], param_1: s32[]) -> f32[1,1024] {
  %param_0 = f32[16,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,1024]{1,0} dynamic-slice(%param_0, %param_1, %constant_0), dynamic_slice_sizes={1,1024}
}

%fused_update (param_0.1: f32[16,1024], param_1.1: f32[1,1024], param_2: s32[]) -> f32[16,1024] {
  %param_0.1 = f32[16,1024]{1,0} parameter(0)
  %param_1.1 = f32[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %constant_1 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[16,1024]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %constant_1)
}

%branch_small (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %negate.1 = f32[1024]{0} negate(%p)
}

%branch_large (p.1: f32[1024]) -> f32[1024] {
  %p.1 = f32[1024]{0} parameter(0)
  %negate.2 = f32[1024]{0} negate(%p.1)
  ROOT %negate.3 = f32[1024]{0} negate(%negate.2)
}

%body (arg: (s32[], f32[16,1024])) -> (s32[], f32[16,1024]) {
  %arg = (s32[], f32[16,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %buf = f32[16,1024]{1,0} get-tuple-element(%arg), index=1
  %fusion-start.1 = ((f32[16,1024]{1,0}, s32[]), f32[1,1024]{1,0}, u32[]) fusion-start(%buf, %i), kind=kLoop, calls=%fused_slice
  %fusion-done.1 = f32[1,1024]{1,0} fusion-done(%fusion-start.1)
  %update = f32[16,1024]{1,0} fusion(%buf, %fusion-done.1, %i), kind=kLoop, calls=%fused_update
  ROOT %tuple.1 = (s32[], f32[16,1024]{1,0}) tuple(%i, %update)
}

%cond (arg.1: (s32[], f32[16,1024])) -> pred[] {
  %arg.1 = (s32[], f32[16,1024]{1,0}) parameter(0)
  ROOT %constant_2 = pred[] constant(true)
}

ENTRY %main (a: f32[16,1024], b: f32[1024], c: s32[]) -> (f32[16,1024], f32[1024]) {
  %a = f32[16,1024]{1,0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %c = s32[] parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,1024]{1,0}) tuple(%zero, %a)
  %while.1 = (s32[], f32[16,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"16"}}
  %out = f32[16,1024]{1,0} get-tuple-element(%while.1), index=1
  %conditional.1 = f32[1024]{0} conditional(%c, %b, %b), branch_computations={%branch_small, %branch_large}
  ROOT %result = (f32[16,1024]{1,0}, f32[1024]{0}) tuple(%out, %conditional.1)
}
"""


def test_in_place_updates_asynchronous_fusions_and_the_costlier_branch():
    row, scalar = 1024 * 4, 4
    # per trip: the slice read and written (+ its index), the update read and written in place
    # (+ its index); 16 trips; then the costlier branch: two negations of 1024 floats
    per_trip = (2 * row + scalar) + (2 * row + scalar)
    expected = 16 * per_trip + 2 * (2 * row)
    moved = traffic(HAND_WRITTEN)
    assert moved.bytes == expected and moved.unknown_loops == 0
    unknown = traffic(HAND_WRITTEN.replace(', backend_config={"known_trip_count":{"n":"16"}}', ""))
    assert unknown.unknown_loops == 1 and unknown.bytes == per_trip + 2 * (2 * row)


def test_the_walk_is_of_the_program_not_of_its_text_size():
    """Two programs with the same kernels but a different number of loop trips: the walk
    tells them apart by the trip count, not by how long their text is."""
    x = np.ones((64, 64), np.float32)

    def loop(trips):
        return lambda x: lax.fori_loop(0, trips, lambda i, h: jnp.sin(h), x)

    fifty, hundred, hundred_fifty = (
        traffic(_compiled_text(loop(t), x)).bytes for t in (50, 100, 150)
    )
    assert hundred_fifty - hundred == hundred - fifty >= 50 * 2 * x.nbytes
