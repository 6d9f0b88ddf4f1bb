"""Plan a run before spending a pod-day: per-device memory and the ring's overlap condition.

    python -m lclm.plan --config configs/llama7b_256k.py [--devices 32] [--device h100-nvlink]
        [--config.data.seq_len=524288 ...] [--measure]

Per device, before anything is compiled: parameter, gradient and optimizer-state bytes under
the mesh's sharding rules; activation bytes (per layer and in all) for the remat policy and
the blockwise chunks; the ring's working set (Ring Attention: about 6 x block x hidden); the total
against the device's memory; tokens per step; and the minimal per-device block for hiding
the ring's transfers on the chosen interconnect (Ring Attention, Table 2: c = FLOPS /
bandwidth).
`--measure` also compiles one real train step on the local devices and prints XLA's memory
analysis (and the measured peak after one step where the device reports it).

    python -m lclm.plan --config configs/llama7b_256k.py --compile v4-64

`--compile TARGET` compiles every stage's train step ahead of time, on this machine, for a TPU
slice (libtpu, no TPU) or for GPUs (`h100:4x8`: JAX's CUDA plugin, no GPU; lclm.aot): compile
time, XLA's per-device memory against the chip's HBM (GPUs: against `aot.gpu_budget`, HBM
less what XLA does not count) and the fused kernels in the program, beside the planner's
estimate. Exit 0 when every stage compiles and fits, 3 when one does not (one line per stage:
what overflowed and what to change), 2 for a bad config or a missing compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import jax

from lclm import aot, logs, strategy_plan
from lclm.cli import parse_cli, run_cli
from lclm.config import LlamaConfig, mesh_device_count
from lclm.config.stages import stage_configs
from lclm.errors import ConfigError, StartupError
from lclm.hardware import planner_devices
from lclm.models.llama import is_param_entry, param_table
from lclm.ops.kernels import get_kernel
from lclm.parallel.mesh import logical_spec
from lclm.train.checks import attention_kernel, validate

# planner device name -> (peak FLOP/s, one-way link GB/s, HBM GiB): lclm.hardware's table
DEVICES = planner_devices()
_BYTES = {"float32": 4, "bfloat16": 2}
_BACKWARD_F32 = 3  # float32 arrays the size of q (and of k) live in the attention backward
# What XLA:GPU holds differently from XLA:TPU for the same step, fitted to lclm.aot's compiles
# of the recipes for H100s (docs/scaling.md): the loss chunk's float32 logits once, not twice,
# and no bulk cast of the weights to the compute dtype (XLA:GPU fuses the casts into the GEMMs)
_GPU = {"backward_f32": _BACKWARD_F32, "loss_copies": 1, "weight_cast": False}


@dataclasses.dataclass
class Plan:
    mesh: dict
    params: float
    grads: float
    optimizer: float
    activations_per_layer: float
    activations: float
    ring: float
    tokens_per_step: int
    local_tokens: int
    min_block: float | None
    device_memory: float | None
    host_activations: float = 0.0  # remat='offload': what the layers keep, in host memory

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.ring


class _MeshShape:
    """Just the axis sizes: what the sharding rules need to decide divisibility."""
    def __init__(self, sizes: dict[str, int]):
        self.shape = sizes


def estimate(config, device_count: int, device: str | None = None) -> Plan:
    """Per-device memory estimate (bytes) of `config` on `device_count` devices."""

    sizes = validate(config, device_count)
    m = LlamaConfig.from_config(config.model)
    mesh = _MeshShape(sizes)
    pbytes, cbytes = _BYTES[m.param_dtype], _BYTES[m.dtype]

    def shard(entry) -> float:
        shape, axes = entry
        spec = logical_spec(axes, shape, mesh)
        split = 1
        for part in spec:
            for a in (part if isinstance(part, tuple) else (part,)):
                if a:
                    split *= sizes[a]
        return math.prod(shape) / split

    table = param_table(m)
    local_params = sum(shard(e) for e in jax.tree.leaves(table, is_leaf=is_param_entry))
    d, a = config.data, config.attention
    sp, tp = sizes["sp"], sizes["tp"]
    batch_local = d.batch_size // config.train.grad_accum // (sizes["dp"] * sizes["fsdp"])
    t = d.seq_len // sp
    kv_dim = m.n_kv_heads * m.head_dim
    heads_local = m.n_heads // tp
    # saved between layers (the scan carries each layer's input) with full remat; more is
    # saved by the lighter policies (about the layer's matmul outputs)
    carry = batch_local * t * m.dim * cbytes
    # 'attention' also keeps the ring's output (compute dtype) and log-sum-exp (float32)
    ring_out = batch_local * t * heads_local * (m.head_dim * cbytes + 4)
    per_layer_saved = {"full": carry, "attention": carry + ring_out, "offload": carry + ring_out,
                       "none": None}.get(m.remat)
    kv_local = max(kv_dim // tp, m.head_dim)
    platform = "tpu" if (device or "").startswith("tpu") else "gpu" if device else None
    kernel = attention_kernel(config, m, sp, platform) if platform else None
    # a fused kernel keeps its score tiles in VMEM / shared memory, the blockwise kernel in HBM
    fused = kernel not in (None, "blockwise")
    # the working set on top of what is saved: the larger of one layer's (its q, o, k, v, the
    # score tiles of the blockwise kernel, the feed-forward chunk, and the attention backward
    # in float32: per-block dq, dk, dv, their running sums, o and do upcast for delta, as the
    # XLA:TPU buffer assignments of the 1B and 7B steps show) and the loss chunk's logits.
    # On a TPU the per-row statistics [.., t, 1] and [.., t, 2] are padded to 128 lanes.
    layer = (batch_local * t * (2 * heads_local * m.head_dim + 2 * kv_local) * cbytes
             + (0 if fused else
                batch_local * heads_local * min(a.q_chunk, t) * min(a.kv_chunk, t) * 4 * 3)
             + batch_local * min(m.ffn_chunk, t) * (m.ffn_dim // tp) * cbytes * 3
             + batch_local * t * 4 * (_GPU["backward_f32"] if platform == "gpu" else _BACKWARD_F32)
             * (heads_local * m.head_dim + kv_local)
             + (2 * batch_local * heads_local * t * 128 * 4 if platform == "tpu" else 0))
    loss = (batch_local * min(m.loss_chunk, t) * (m.vocab_size // tp) * 4
            * (_GPU["loss_copies"] if platform == "gpu" else 2))
    # measured, not derived: with every layer's residuals on the device XLA's peak holds both
    # working sets, with them offloaded it holds the larger (XLA:TPU, 7B stages on a v4-64)
    inside = max(layer, loss) if m.remat == "offload" else layer + loss
    if per_layer_saved is None:  # no remat: everything of every layer is kept, and the
        # feed-forward keeps its chunks' gate and up projections (lclm.ops.ffn save_hidden)
        per_layer_saved = carry * 4 + inside + 2 * batch_local * t * (m.ffn_dim // tp) * cbytes
    elif m.remat not in ("full", "attention", "offload"):
        per_layer_saved = carry * 4
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
    # the ring: K/V held + in flight (compute dtype) and dK/dV accumulators travelling (f32)
    ring = (batch_local * t * 2 * (kv_dim // max(1, min(tp, m.n_kv_heads))) * (2 * cbytes + 4)
            if sp > 1 else 0)
    host = 0.0
    if m.remat == "offload" and platform == "gpu":
        host, per_layer_saved = per_layer_saved * m.n_layers, per_layer_saved
        # Fitted, not derived (11 XLA:GPU compiles of the offload recipes on H100s, within
        # -10% .. +4%, docs/scaling.md): with the layers' residuals in host memory XLA:GPU's
        # peak is the larger of two phases. The loss and feed-forward chunks: their float32
        # logits and compute-dtype activations, each with its gradient. Or the attention
        # backward: the ring's buffers, q/k/v/o, one float32 set of q and k's size, the residual
        # stream; the layer's saved residuals streamed in from the host are not held beside them.
        chunks = 2 * (loss + batch_local * min(m.ffn_chunk, t) * (m.ffn_dim // tp) * cbytes * 3)
        attention_backward = (ring + batch_local * t * (2 * heads_local * m.head_dim + 2 * kv_local)
                              * cbytes + batch_local * t * 4 * (heads_local * m.head_dim + kv_local)
                              + residual)
        if sp > 1 and kernel and get_kernel(kernel).compute_dtype_rounds:
            # the kernel's compute-dtype o, do, dq (q's size) and dk, dv (k's) beside the
            # ring's float32 accumulators: tokamax_gpu's 7B stages on h100:4x8 need 1.24 GiB
            # more than pallas_gpu's where this is 1.25. With one round nothing accumulates
            # (llama1b offloaded at 512K on one H100: 1.7 GiB more, not this term's 7)
            attention_backward += batch_local * t * (3 * heads_local * m.head_dim
                                                     + 2 * kv_local) * cbytes
        activations = max(chunks, attention_backward) - ring   # the ring is counted on its own
    elif m.remat == "offload":  # on the device only the layer being recomputed (and its copy)
        host, per_layer_saved = per_layer_saved * m.n_layers, per_layer_saved
        activations = 2 * per_layer_saved + inside + residual
    else:
        activations = per_layer_saved * m.n_layers + inside + residual
    min_block: float | None = None
    device_memory: float | None = None
    if device in DEVICES:  # an unknown or no device: neither is known
        flops, bandwidth, memory = DEVICES[device]
        min_block, device_memory = flops / (bandwidth * 1e9), memory * 2**30
    return Plan(mesh=sizes, params=local_params * pbytes, grads=local_params * 4,
                optimizer=2 * local_params * pbytes, activations_per_layer=per_layer_saved,
                activations=activations, ring=ring, tokens_per_step=d.batch_size * d.seq_len,
                local_tokens=t, min_block=min_block, device_memory=device_memory,
                host_activations=host)


def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f}"


def report(plan: Plan, device: str | None) -> str:
    gib = lambda x: f"{_gib(x)} GiB"
    rows = [("mesh", str(plan.mesh)), ("tokens per step", f"{plan.tokens_per_step:,}"),
            ("tokens per device (sequence block)", f"{plan.local_tokens:,}"),
            ("parameters", gib(plan.params)), ("gradients (float32)", gib(plan.grads)),
            ("optimizer state (AdamW)", gib(plan.optimizer)),
            ("activations saved per layer", gib(plan.activations_per_layer)),
            ("activations in all (+ one layer's working set)", gib(plan.activations)),
            ("ring working set", gib(plan.ring)), ("total", gib(plan.total))]
    if plan.host_activations:
        rows.append(("host memory (remat='offload': saved activations)",
                     gib(plan.host_activations)))
    if plan.device_memory:
        rows.append((f"{device} memory", f"{gib(plan.device_memory)} "
                     f"({100 * plan.total / plan.device_memory:.0f}% used)"))
    if plan.min_block:
        ok = "overlaps" if plan.local_tokens >= plan.min_block else "does NOT overlap"
        rows.append(("min block to hide the ring (FLOPS/bandwidth)",
                     f"{plan.min_block:,.0f} tokens: the ring {ok}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _plans(config, args) -> tuple[list, list[Plan]]:
    """(the configs of the run, one per stage, and their plans); bad input is a StartupError."""
    count = args.devices or mesh_device_count(config)
    if count is None:
        raise ConfigError("the mesh has a -1 axis; pass --devices N (the devices of the run)")
    # a staged recipe is planned stage by stage; the longest stage decides the fit
    runs = stage_configs(config) if config.stages.schedule else [config]
    return runs, [estimate(c, count, args.device) for c in runs]


_FIXES = {"HBM": "shard more (mesh.fsdp/sp), lower data.batch_size, or model.remat='offload'",
          "VMEM": "attention.impl='blockwise' (no Mosaic kernel), and report the TPU: "
                  "pallas_tpu sizes its tiles per generation (TPU_TILES)"}


def _compile_stages(config, args) -> int:
    """`--compile TARGET`: every stage compiled for a TPU slice or GPUs; exit 0 if all fit,
    else 3."""
    target = aot.target(args.compile)
    devices = aot.target_devices(target)
    device = target.planner_device if target.planner_device in DEVICES else None
    gpu = target.platform == "gpu"
    budget, how = aot.gpu_budget(target) if gpu else (target.hbm_bytes, "")

    runs = stage_configs(config) if config.stages.schedule else [config]
    if gpu:
        print(f"{target.name}: {target.devices} x {devices[0].device_kind} ({target.nodes} "
              f"node(s) of {target.devices // target.nodes}), "
              f"{_gib(target.hbm_bytes)} GiB HBM each; budget {how}")
    else:
        print(f"{target.name}: {target.devices} devices ({target.topology}"
              f"{', ' + target.chip_config if target.chip_config else ''}), "
              f"{_gib(target.hbm_bytes)} GiB HBM each")
    kernels = "kernels" if gpu else "Mosaic kernels"
    of = "budget" if gpu else "HBM"
    print(f"| stage | seq_len | compile s | arguments GiB | temporaries GiB | outputs GiB | "
          f"total GiB | {of} used | {kernels} | planner GiB | host GiB (planner) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = []
    for i, c in enumerate(runs):
        # the planner's kernel is the one the compile picks: both for the target's device
        with aot.compiling_for(devices[0]):
            plan = estimate(c, target.devices, device)
        planned, host = plan.total, plan.host_activations
        try:
            r = aot.compile_step(c, devices)
        except StartupError:
            raise
        except Exception as e:  # noqa: BLE001  (XLA reports overflows as compile errors)
            kind = aot.overflow(e)
            if kind is None:
                raise
            failed.append(f"stage {i} (seq_len {c.data.seq_len:,}): {kind} overflow on "
                          f"{target.name}; {_FIXES[kind]}")
            print(f"| {i} | {c.data.seq_len:,} | - | - | - | - | {kind} overflow | - | - | "
                  f"{_gib(planned)} | - |", flush=True)
            continue
        used = r.total / budget
        if used > 1:
            failed.append(f"stage {i} (seq_len {c.data.seq_len:,}): {_gib(r.total)} GiB of "
                          f"{_gib(budget)} GiB {'budget' if gpu else 'HBM'} on {target.name}; "
                          f"{_FIXES['HBM']}")
        host_cell = f"{_gib(r.host)} ({_gib(host)})" if r.host else f"- ({_gib(host)})"
        print(f"| {i} | {c.data.seq_len:,} | {r.seconds:,.0f} | {_gib(r.arguments)} | "
              f"{_gib(r.temporaries)} | {_gib(r.outputs)} | {_gib(r.total)} | {100 * used:.0f}% | "
              f"{r.kernels} | {_gib(planned)} | {host_cell} |", flush=True)
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 3 if failed else 0


def _links(device: str, per_node: int) -> tuple[float, float, float, int, str]:
    """(peak FLOP/s, GB/s in a node, GB/s between nodes, devices per node, description)."""
    flops, fast, _ = DEVICES[device]
    family = device.split("-")[0]
    if family == "tpu":   # one interconnect (ICI) for the whole slice: one "node"
        return flops, fast, fast, 1 << 30, f"{device}, one interconnect (ICI) {fast:g} GB/s"
    slow = DEVICES.get(f"{family}-ib", DEVICES[device])[1]
    return (flops, fast, slow, per_node,
            f"{device}, {per_node} per node: {fast:g} GB/s inside, {slow:g} GB/s between nodes")


def _strategies(runs, plans, args) -> int:
    """`--strategies`: every stage's strategies, least exposed transfer time first."""
    if args.device is None:
        raise ConfigError("--strategies compares links: pass --device (e.g. h100-nvlink)")
    flops, fast, slow, per_node, links = _links(args.device, args.devices_per_node)
    for i, (c, plan) in enumerate(zip(runs, plans)):
        print(f"\n== stage {i}: seq_len {c.data.seq_len:,}, mesh {plan.mesh}; {links}")
        print("| strategy | split | GB sent in a node | GB sent between nodes | exposed s | "
              "GiB per device | note |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        costs = strategy_plan.compare(c, plan.mesh, flops, fast, slow, per_node)
        for cost in sorted(costs, key=lambda x: (bool(x.note.endswith("cannot run")),
                                                 x.exposed_s,
                                                 x.sent.get("between nodes", 0.0))):
            inside, between = (cost.sent.get(k, 0.0) / 1e9 for k in ("in a node",
                                                                      "between nodes"))
            exposed = "hidden" if cost.exposed_s == 0 else f"{cost.exposed_s:.3f}"
            memory = (plan.total - plan.ring + cost.memory) / 2**30
            print(f"| {cost.strategy} | {cost.split} | {inside:,.1f} | {between:,.1f} | "
                  f"{exposed} | {memory:,.2f} | {cost.note} |")
    print("\nper device and training step; exposed: seconds the attention waits for its "
          "transfers at peak FLOP/s (see lclm/strategy_plan.py)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lclm.plan", description=__doc__.split("\n")[0],
                                 epilog="config fields: --config.<key>=<value>, as for train.py")
    ap.add_argument("--devices", type=int, default=0,
                    help="device count (default: the mesh's product, or the local devices)")
    ap.add_argument("--device", choices=sorted(DEVICES), default=None)
    ap.add_argument("--strategies", action="store_true",
                    help="rank the context-parallel strategies (ring, all_gather, ulysses, usp) "
                         "by the time their transfers leave exposed, with bytes sent per link "
                         "and memory per device (needs --device)")
    ap.add_argument("--devices-per-node", type=int, default=8,
                    help="GPUs per node for --strategies: inside a node --device's link, "
                         "between nodes its -ib link (default 8; TPU slices: one ICI)")
    ap.add_argument("--measure", action="store_true",
                    help="also compile (and run) one step on the local devices")
    ap.add_argument("--compile", metavar="TARGET", default="",
                    help="compile every stage ahead of time for a TPU slice (needs libtpu, no "
                         "TPU: v4-N and v5p-N count TensorCores, 2 per chip, one megacore "
                         "device: v4-64 = 32 chips, topology v4:2x4x4; v5e-N and v6e-N count "
                         "chips) or GPUs (needs lclm[gpu-aot], no GPU: h100:N, N GPUs on one "
                         "node; h100:MxN, M nodes of N; h200:..., a100:...)")
    logs.configure()
    return run_cli(lambda: _run(ap, argv))


def _run(ap: argparse.ArgumentParser, argv) -> int:
    args, config = parse_cli(ap, argv)
    if args.compile:
        return _compile_stages(config, args)
    runs, plans = _plans(config, args)
    if args.strategies:
        return _strategies(runs, plans, args)
    for i, (c, plan) in enumerate(zip(runs, plans)):
        if len(runs) > 1:
            print(f"\n== stage {i}: seq_len {c.data.seq_len:,}, rope_theta {c.model.rope_theta:g}, "
                  f"{c.train.steps} steps of {c.data.batch_size} sequences")
        print(report(plan, args.device))
        if plan.device_memory and plan.total > plan.device_memory and c.model.remat != "offload":
            offload = c.copy_and_resolve_references()
            offload.model.remat = "offload"
            count = args.devices or mesh_device_count(offload)
            # not None: _plans required --devices for a mesh with a -1 axis; stages set sp >= 1
            assert count is not None
            alt = estimate(offload, count, args.device)
            assert alt.device_memory is not None  # the same device as `plan`'s
            print(f"does not fit; with model.remat='offload': {alt.total / 2**30:,.2f} GiB on "
                  f"the device ({100 * alt.total / alt.device_memory:.0f}%), "
                  f"{alt.host_activations / 2**30:,.2f} GiB in host memory")
    if args.measure:  # the same step the benchmark times, at the last (longest) stage
        import runpy
        last = runs[-1]  # the benchmark measures the fields it is given, not the stages
        stage = [f"--config.{key}={value}" for key, value in (
            ("data.seq_len", last.data.seq_len), ("data.batch_size", last.data.batch_size),
            ("model.rope_theta", last.model.rope_theta), ("mesh.sp", last.mesh.sp))
                 ] if config.stages.schedule else []
        sys.argv = ["bench.train_step", "--config", args.config, "--steps", "1",
                    *args.overrides, *stage]
        runpy.run_module("bench.train_step", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
