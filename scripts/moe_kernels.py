"""The grouped-matmul kernels for a mixture-of-experts layer, compiled for one TPU chip
without a TPU (libtpu's compiler, as ``grpo plan`` uses it), at Qwen3-30B-A3B's shapes:

    python scripts/moe_kernels.py [--pairs 65536] [--topology v6e:2x2]

Prints one JSON object: for each kernel, forward and forward + backward, whether it
compiles and, if so, its cost analysis (TFLOP, GB read) and temporaries, or the
compiler's error. Kernels: ``jax.lax.ragged_dot`` (XLA's lowering), JAX's Megablox
``gmm`` (Pallas) and, when installed (``pip install tokamax`` in a virtualenv of your
own), Tokamax's Mosaic ``ragged_dot``. docs/guides/moe.md gives the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def kernels():
    yield "xla ragged_dot", lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.bfloat16)
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    yield "megablox gmm", lambda x, w, g: gmm(x, w, g, preferred_element_type=jnp.bfloat16)
    try:
        import tokamax
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu
    except ImportError:
        return
    # Tokamax checks the arguments' devices (tracers have none here, so the host's CPU).
    pallas_mosaic_tpu.PallasMosaicTpuRaggedDot.supported_on = lambda self, device: True
    yield "tokamax mosaic", lambda x, w, g: tokamax.ragged_dot(
        x, w, g, preferred_element_type=jnp.bfloat16, implementation="mosaic")


def compile_one(fn, args, mesh) -> dict:
    t = time.time()
    try:
        with jax.set_mesh(mesh):  # Pallas reads the TPU generation from the mesh's device
            compiled = jax.jit(fn).lower(*args).compile()
    except Exception as err:  # noqa: BLE001 - the compiler's message is the result
        return {"compiles": False, "error": (str(err).strip().splitlines() or [type(err).__name__])[0][:300]}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out = {"compiles": True, "tflop": cost.get("flops", 0.0) / 1e12, "gb_read": cost.get("bytes accessed", 0.0) / 1e9,
           "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30, "compile_s": round(time.time() - t, 1)}
    try:  # reading the compiled HLO back fails for Pallas kernels with JAX 0.10.2's libtpu (a RET_CHECK)
        out["custom_call"] = "custom-call" in compiled.as_text()
    except Exception as err:  # noqa: BLE001
        out["hlo_text_error"] = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=65536, help="token-expert pairs (rows)")
    ap.add_argument("--topology", default="v6e:2x2", help="a TPU topology libtpu describes (one chip is used)")
    args = ap.parse_args()
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices[0]
    mesh = Mesh([[device]], ("a", "b"))
    rep = NamedSharding(mesh, PartitionSpec())
    M, K, N, G = args.pairs, 2048, 768, 128  # Qwen3-30B-A3B: hidden 2048, expert width 768, 128 experts
    shapes = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rep),
              jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16, sharding=rep),
              jax.ShapeDtypeStruct((G,), jnp.int32, sharding=rep))
    out: dict = {"shape": {"pairs": M, "hidden": K, "width": N, "experts": G}, "useful_tflop_forward": 2 * M * K * N / 1e12}
    for name, f in kernels():
        def both(x, w, g, f=f):
            return jax.grad(lambda x, w: jnp.sum(f(x, w, g).astype(jnp.float32)), argnums=(0, 1))(x, w)

        out[name] = {"forward": compile_one(f, shapes, mesh), "forward+backward": compile_one(both, shapes, mesh)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
