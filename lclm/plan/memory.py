"""The planner's memory model: per device, before anything is compiled, parameter, gradient
and optimizer-state bytes under the mesh's sharding rules; activation bytes (per layer and in
all) for the remat policy and the blockwise chunks; the attention strategy's buffers, as the
strategy states them (`Strategy.buffers`; the ring's, Ring Attention: about 6 x block x
hidden); the total against the device's memory; tokens per step; and the
minimal per-device block for hiding the ring's transfers on the chosen interconnect (Ring
Attention, Table 2: c = FLOPS / bandwidth). `estimate` computes it, `report` prints it.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import jax

from lclm.config.model import DTYPE_BYTES, REMAT
from lclm.hardware import planner_devices
from lclm.models.decoder import is_param_entry, param_table
from lclm.ops.context_parallel import strategy_of
from lclm.ops.kernels import get_kernel
from lclm.parallel.mesh import logical_spec
from lclm.plan.strategies import attention_step
from lclm.train.remat_choice import AUTO, AUTO_ORDER, gpu_budget
from lclm.train.startup_checks import attention_kernel, checked

# planner device name -> (peak FLOP/s, one-way link GB/s, HBM GiB): lclm.hardware's table
DEVICES = planner_devices()
_BACKWARD_F32 = 3  # float32 arrays the size of q (and of k) live in the attention backward
# What XLA:GPU holds differently from XLA:TPU for the same step, fitted to lclm.plan.aot's compiles
# of the recipes for H100s (docs/scaling.md): the loss chunk's float32 logits once, not twice,
# and no bulk cast of the weights to the compute dtype (XLA:GPU fuses the casts into the GEMMs)
_GPU = {"backward_f32": _BACKWARD_F32, "loss_copies": 1, "weight_cast": False}
# model.remat='auto' planned: a policy is taken where its estimate is within this share of the
# budget, as the estimates of 'none' run up to 14% under XLA's (a run decides by compiling)
_AUTO_SHARE = 0.85


@dataclasses.dataclass
class Plan:
    mesh: dict
    params: float
    grads: float
    optimizer: float
    activations_per_layer: float
    activations: float
    ring: float  # the attention strategy's buffers (`Strategy.buffers`)
    tokens_per_step: int
    local_tokens: int
    min_block: float | None
    device_memory: float | None
    host_activations: float = 0.0  # remat='offload': what the layers keep, in host memory
    remat: str = ""  # the policy planned ('auto' resolved)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.ring


class _MeshShape:
    """Just the axis sizes: what the sharding rules need to decide divisibility."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = sizes


def estimate(config, device_count: int, device: str | None = None) -> Plan:
    """Per-device memory estimate (bytes) of `config` (one stage) on `device_count` devices.
    `model.remat='auto'` is planned as the run chooses it (`lclm.train.remat_choice`), by
    these estimates instead of compiles: the first of `AUTO_ORDER` whose estimate is within
    `_AUTO_SHARE` of `device`'s memory (a GPU's: the pool JAX makes there, `gpu_budget`; the
    last where none is); with no device, as `REMAT_AUTO_FALLBACK`."""
    if config.model.remat == AUTO and device in DEVICES:
        plan = None
        for policy in AUTO_ORDER:
            c = copy.deepcopy(config)
            c.model.remat = policy
            plan = estimate(c, device_count, device)
            assert plan.device_memory is not None  # a known device
            budget = (
                plan.device_memory
                if device.startswith("tpu")
                else gpu_budget(plan.device_memory)[0]
            )
            if plan.total <= _AUTO_SHARE * budget:
                break
        assert plan is not None
        return plan
    _, sections, sizes = checked(config, device_count)
    m = sections.model.resolved()
    mesh = _MeshShape(sizes)
    pbytes, cbytes = DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[m.dtype]
    remat = REMAT[m.remat]

    def shard(entry) -> float:
        shape, axes = entry
        spec = logical_spec(axes, shape, mesh)
        split = 1
        for part in spec:
            for a in part if isinstance(part, tuple) else (part,):
                if a:
                    split *= sizes[a]
        return math.prod(shape) / split

    table = param_table(m)
    local_params = sum(shard(e) for e in jax.tree.leaves(table, is_leaf=is_param_entry))
    d, a = sections.data, sections.attention
    sp, tp = sizes["sp"], sizes["tp"]
    batch_local = d.batch_size // sections.train.grad_accum // (sizes["dp"] * sizes["fsdp"])
    t = d.seq_len // sp
    kv_dim = m.n_kv_heads * m.head_dim
    heads_local = m.n_heads // tp
    # saved between layers (the scan carries each layer's input) by every policy
    carry = batch_local * t * m.dim * cbytes
    # the attention's output (compute dtype) and log-sum-exp (float32), where they are kept
    ring_out = batch_local * t * heads_local * (m.head_dim * cbytes + 4)
    kv_local = max(kv_dim // tp, m.head_dim)
    platform = "tpu" if (device or "").startswith("tpu") else "gpu" if device else None
    kernel = attention_kernel(a, d.seq_len, m, sp, platform) if platform else None
    # a fused kernel keeps its score tiles in VMEM / shared memory, the blockwise kernel in HBM
    fused = kernel not in (None, "blockwise")
    # the working set on top of what is saved: the larger of one layer's (its q, o, k, v, the
    # score tiles of the blockwise kernel, the feed-forward chunk, and the attention backward
    # in float32: per-block dq, dk, dv, their running sums, o and do upcast for delta, as the
    # XLA:TPU buffer assignments of the 1B and 7B steps show) and the loss chunk's logits.
    # On a TPU the per-row statistics [.., t, 1] and [.., t, 2] are padded to 128 lanes.
    layer = (
        batch_local * t * (2 * heads_local * m.head_dim + 2 * kv_local) * cbytes
        + (
            0
            if fused
            else batch_local * heads_local * min(a.q_chunk, t) * min(a.kv_chunk, t) * 4 * 3
        )
        + batch_local * min(m.ffn_chunk, t) * (m.ffn_dim // tp) * cbytes * 3
        + batch_local
        * t
        * 4
        * (_GPU["backward_f32"] if platform == "gpu" else _BACKWARD_F32)
        * (heads_local * m.head_dim + kv_local)
        + (2 * batch_local * heads_local * t * 128 * 4 if platform == "tpu" else 0)
    )
    loss = (
        batch_local
        * min(m.loss_chunk, t)
        * (m.vocab_size // tp)
        * 4
        * (_GPU["loss_copies"] if platform == "gpu" else 2)
    )
    # measured, not derived: with every layer's residuals on the device XLA's peak holds both
    # working sets, with them offloaded it holds the larger (XLA:TPU, 7B stages on a v4-64)
    inside: float = max(layer, loss) if remat.host else layer + loss
    q_dim, ffn_local = heads_local * m.head_dim, m.ffn_dim // tp
    if remat.everything:
        # no remat: every value a layer computes, per token: six of width dim (its input, both
        # norms' outputs, the attention's output projection, the residual after it, the
        # feed-forward's output), q, k, v and the rotated q and k, the attention's output and
        # log-sum-exp, and the feed-forward chunks' gate and up projections (lclm.ops.ffn
        # save_hidden); the working set once, not per layer (charging it per layer was 2x
        # XLA's figure: LLaMA-3.2-1B 66.3 against 30.4 GiB at 8K on an H100, 153 against 74 at
        # 32K on a v5p chip; now -2%, -14%; 4 layers of width 256 at 4K on a CPU, -7%)
        per_layer_saved = (
            batch_local * t * (6 * m.dim + 2 * q_dim + 3 * kv_local + 2 * ffn_local) * cbytes
            + ring_out
        )
    elif remat.matmuls:
        # the layer input and the outputs of its weight matmuls outside the fused ops: q, k, v
        # and the attention's output projection (the feed-forward and a fused attention kernel
        # are custom ops whose insides these policies do not see; under the blockwise kernel
        # 'dots' also keeps its score tiles, which this leaves out). dots_no_batch on a CPU
        # (as above): -11% of XLA's total, where charging it as 'none' was +138%
        per_layer_saved = carry * 2 + batch_local * t * (q_dim + 2 * kv_local) * cbytes
    elif remat.attention_residuals:
        per_layer_saved = carry + ring_out
    else:
        per_layer_saved = carry
    if m.dtype != m.param_dtype and (platform != "gpu" or _GPU["weight_cast"]):
        # XLA casts every local weight to the compute dtype at once
        inside += local_params * cbytes
    if shard(table["embed"]) < m.vocab_size * m.dim:
        # sharded embeddings are gathered whole for the lookup and the head's matmul (compute
        # dtype, one copy each way round), and the head's float32 gradient is whole until it
        # is reduce-scattered (the buffer assignments show all three)
        inside += m.vocab_size * m.dim * (2 * cbytes + 4)
    # the residual stream and its gradient, float32
    residual = batch_local * t * m.dim * 4 * 2
    # what the strategy holds for the attention (the ring: K/V in flight and the float32
    # dK/dV accumulators travelling); over one device nothing crosses, nothing is held
    step = attention_step(
        sections, sizes, flops=0.0, fast_gbs=0.0, slow_gbs=0.0, devices_per_node=sp
    )  # (the links do not change what it holds)
    ring = strategy_of(a).buffers(step) if sp > 1 else 0.0
    host = 0.0
    if remat.host and platform == "gpu":
        host, per_layer_saved = per_layer_saved * m.n_layers, per_layer_saved
        # Fitted, not derived (11 XLA:GPU compiles of the offload recipes on H100s, within
        # -10% .. +4%, docs/scaling.md): with the layers' residuals in host memory XLA:GPU's
        # peak is the larger of two phases. The loss and feed-forward chunks: their float32
        # logits and compute-dtype activations, each with its gradient. Or the attention
        # backward: the ring's buffers, q/k/v/o, one float32 set of q and k's size, the residual
        # stream; the layer's saved residuals streamed in from the host are not held beside them.
        chunks = 2 * (loss + batch_local * min(m.ffn_chunk, t) * (m.ffn_dim // tp) * cbytes * 3)
        attention_backward = (
            ring
            + batch_local * t * (2 * heads_local * m.head_dim + 2 * kv_local) * cbytes
            + batch_local * t * 4 * (heads_local * m.head_dim + kv_local)
            + residual
        )
        if sp > 1 and kernel and get_kernel(kernel).compute_dtype_rounds:
            # the kernel's compute-dtype o, do, dq (q's size) and dk, dv (k's) beside the
            # ring's float32 accumulators: tokamax_gpu's 7B stages on h100:4x8 need 1.24 GiB
            # more than pallas_gpu's where this is 1.25. With one round nothing accumulates
            # (llama1b offloaded at 512K on one H100: 1.7 GiB more, not this term's 7)
            attention_backward += (
                batch_local * t * (3 * heads_local * m.head_dim + 2 * kv_local) * cbytes
            )
        activations = max(chunks, attention_backward) - ring  # the ring is counted on its own
    elif remat.host:  # on the device only the layer being recomputed (and its copy)
        host, per_layer_saved = per_layer_saved * m.n_layers, per_layer_saved
        activations = 2 * per_layer_saved + inside + residual
    else:
        activations = per_layer_saved * m.n_layers + inside + residual
    min_block: float | None = None
    device_memory: float | None = None
    if device in DEVICES:  # an unknown or no device: neither is known
        flops, bandwidth, memory = DEVICES[device]
        min_block, device_memory = flops / (bandwidth * 1e9), memory * 2**30
    return Plan(
        mesh=sizes,
        params=local_params * pbytes,
        grads=local_params * 4,
        optimizer=2 * local_params * pbytes,
        activations_per_layer=per_layer_saved,
        activations=activations,
        ring=ring,
        tokens_per_step=d.batch_size * d.seq_len,
        local_tokens=t,
        min_block=min_block,
        device_memory=device_memory,
        host_activations=host,
        remat=m.remat,
    )


def gib(x: float) -> str:
    return f"{x / 2**30:,.2f}"


def report(plan: Plan, device: str | None) -> str:
    with_unit = lambda x: f"{gib(x)} GiB"
    rows = [
        ("mesh", str(plan.mesh)),
        ("remat policy", plan.remat),
        ("tokens per step", f"{plan.tokens_per_step:,}"),
        ("tokens per device (sequence block)", f"{plan.local_tokens:,}"),
        ("parameters", with_unit(plan.params)),
        ("gradients (float32)", with_unit(plan.grads)),
        ("optimizer state (AdamW)", with_unit(plan.optimizer)),
        ("activations saved per layer", with_unit(plan.activations_per_layer)),
        ("activations in all (+ one layer's working set)", with_unit(plan.activations)),
        ("ring working set", with_unit(plan.ring)),
        ("total", with_unit(plan.total)),
    ]
    if plan.host_activations:
        rows.append(
            ("host memory (remat='offload': saved activations)", with_unit(plan.host_activations))
        )
    if plan.device_memory:
        rows.append(
            (
                f"{device} memory",
                f"{with_unit(plan.device_memory)} "
                f"({100 * plan.total / plan.device_memory:.0f}% used)",
            )
        )
    if plan.min_block:
        ok = "overlaps" if plan.local_tokens >= plan.min_block else "does NOT overlap"
        rows.append(
            (
                "min block to hide the ring (FLOPS/bandwidth)",
                f"{plan.min_block:,.0f} tokens: the ring {ok}",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
