"""``grpo bench memory``: what FSDP sharding vs an all-gather costs per device.

Allocates a ``[rows, cols]`` buffer (rows rounded up to a multiple of fsdp) sharded over
the mesh's fsdp axis; in ``gather`` mode the buffer is then replicated on every device (an
all-gather, as when FSDP gathers a layer's weights). Per-device bytes are read from the
arrays' addressable shards, and device memory stats where the backend reports them, and
aggregated across processes with a 64-bit-safe gather (some backends narrow int64 to
int32 in collectives, so each value travels as two 32-bit words).
"""

from __future__ import annotations

import json
import math

import click
import numpy as np

from grpo.core.errors import UserError

GIB = 1024**3


def gather_int64(values: list[int]) -> np.ndarray:
    """All processes' int values as an int64 array [process, len(values)]."""
    import jax
    from jax.experimental import multihost_utils

    arr = np.asarray(values, dtype=np.int64).view(np.uint64)
    words = np.stack([(arr >> np.uint64(32)).astype(np.uint32), (arr & np.uint64(0xFFFFFFFF)).astype(np.uint32)], -1)
    if jax.process_count() == 1:
        gathered = words[None]
    else:
        gathered = np.asarray(multihost_utils.process_allgather(words.view(np.int32)))
        gathered = gathered.reshape(jax.process_count(), len(values), 2).view(np.uint32)
    hi, lo = gathered[..., 0].astype(np.uint64), gathered[..., 1].astype(np.uint64)
    return ((hi << np.uint64(32)) | lo).astype(np.int64)


def run_memory_bench(
    *, policy: str, shape: str | None, mode: str, dtype: str, target_bytes: int, cols: int
) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo.core.plugins import get_plugins
    from grpo.engine.parallel.mesh import build_mesh, current_topology

    plugin = get_plugins().get("mesh", policy)
    options = plugin.parse_options({"shape": shape} if shape else {})
    layout = plugin.resolve(current_topology(), options)
    mesh = build_mesh(layout)
    jdtype = jnp.dtype({"bf16": "bfloat16", "f32": "float32", "bfloat16": "bfloat16", "float32": "float32"}[dtype])
    itemsize = jdtype.itemsize
    rows = max(1, math.ceil(target_bytes / (cols * itemsize)))
    rows = math.ceil(rows / layout.fsdp) * layout.fsdp
    sharded = NamedSharding(mesh, P("fsdp", None))
    replicated = NamedSharding(mesh, P())
    make = jax.jit(lambda: jnp.ones((rows, cols), jdtype), out_shardings=sharded)
    x = make()
    if mode == "gather":
        x = jax.jit(lambda a: a, out_shardings=replicated)(x)
    x.block_until_ready()
    per_device: dict[int, int] = {}
    for s in x.addressable_shards:
        per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    local_max = max(per_device.values())
    in_use, peak = [], []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        if "bytes_in_use" in stats:
            in_use.append(int(stats["bytes_in_use"]))
        if "peak_bytes_in_use" in stats:
            peak.append(int(stats["peak_bytes_in_use"]))
    gathered = gather_int64([local_max, max(in_use, default=-1), max(peak, default=-1)])
    out = {
        "device": jax.devices()[0].device_kind,
        "processes": jax.process_count(),
        "mesh_shape": layout.shape,
        "mode": mode,
        "dtype": str(jdtype),
        "rows": rows,
        "cols": cols,
        "actual_total_bytes": rows * cols * itemsize,
        "per_device_array_bytes_local_max": local_max,
        "per_device_array_bytes_all_processes_max": int(gathered[:, 0].max()),
        "warnings": list(layout.warnings),
    }
    if in_use:
        out["bytes_in_use_max"] = int(gathered[:, 1].max())
    if peak:
        out["peak_bytes_in_use_max"] = int(gathered[:, 2].max())
    return out


@click.command("memory")
@click.option("--mesh", "policy", default="auto", show_default=True, help="Mesh policy name.")
@click.option("--shape", help="Shape for the explicit policy.")
@click.option("--mode", type=click.Choice(["sharded", "gather"]), default="sharded", show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "f32"]), default="bf16", show_default=True)
@click.option("--target-bytes-gib", type=float, default=5.6, show_default=True,
              help="Buffer size; 5.6 GiB is Qwen2.5-3B in bf16.")
@click.option("--cols", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One line of JSON (default: indented JSON).")
@click.option("--coordinator-address", help="host:port of process 0, to run on several processes (same command on each).")
@click.option("--num-processes", type=click.IntRange(min=1), help="Process count (with --coordinator-address).")
@click.option("--process-id", type=click.IntRange(min=0), help="This process's id (with --coordinator-address).")
def bench_memory(policy, shape, mode, dtype, target_bytes_gib, cols, as_json,
                 coordinator_address, num_processes, process_id) -> None:
    """FSDP memory: a [rows, cols] buffer sharded over fsdp, or all-gathered."""
    if target_bytes_gib <= 0:
        raise UserError(f"--target-bytes-gib must be > 0, got {target_bytes_gib}")
    if coordinator_address is not None:
        from grpo.core.config import DistributedConfig
        from grpo.engine.parallel import distributed

        distributed.initialize(DistributedConfig(
            mode="explicit", coordinator_address=coordinator_address, num_processes=num_processes,
            process_id=process_id,
        ))
    result = run_memory_bench(
        policy=policy, shape=shape, mode=mode, dtype=dtype, target_bytes=int(target_bytes_gib * GIB), cols=cols
    )
    import jax

    if jax.process_index() == 0:
        click.echo(json.dumps(result, indent=None if as_json else 2))
