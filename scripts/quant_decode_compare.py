"""Compare int8/fp8 rollout matmuls on the compiled TPU decode (issue 53): bytes, flops
and fusion of one decode step's MLP and attention projections of a Qwen2.5-3B layer per
chip at tensor_parallel 4 (the v6e-8 recipe's rollout), batch ``--rows``, for

- ``bf16``: the unquantized baseline;
- ``direct_w8``: grpo's path (:func:`grpo.models.rollout_quant.quantized_matmul`): int8
  codes converted in the matmul, float32 accumulation, per-channel scale after;
- ``direct_w8a8``: ``jax.lax.dot_general`` int8 x int8 -> int32 (activations quantized per row);
- ``qwix_w8`` / ``qwix_w8a8``: Qwix's ``dot_general`` on ``qwix.quantize``'d arrays
  (weights per output channel; activations per row);
- ``fp8_w8`` / ``fp8_w8a8``: float8_e4m3fn codes (what libtpu makes of fp8).

Needs ``libtpu`` (the compiler runs without a TPU); Qwix is optional (``pip install
qwix``). Prints JSON. ``python scripts/quant_decode_compare.py --topology v6e:2x4``;
``--topology local`` times the variants on this machine's accelerator instead (a GPU).
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps

# Qwen2.5-3B per chip at tp 4: hidden 2048, mlp 11008 / 4, 16 query heads / 4 of 128, 2 KV heads (replicated at tp 4)
D, F, H, KH, E = 2048, 11008 // 4, 4, 2, 128


def _weights(fmt):
    dt = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[fmt]
    shapes = {"q": (D, H * E), "k": (D, KH * E), "v": (D, KH * E), "o": (H * E, D), "gate": (D, F), "up": (D, F),
              "down": (F, D)}
    return {n: jax.ShapeDtypeStruct(s, dt) for n, s in shapes.items()}, {n: jax.ShapeDtypeStruct((s[1],), jnp.float32)
                                                                      for n, s in shapes.items()}


def layer(matmul):
    """One decode step's projections of a layer (attention itself left out: it is the same
    for every variant): x [B, D] -> q, k, v, o, then the SwiGLU MLP."""
    def fn(x, w, s):
        q = matmul(x, w["q"], s["q"])
        k = matmul(x, w["k"], s["k"])
        v = matmul(x, w["v"], s["v"])
        a = (q + jnp.tile(k + v, (1, 2))).astype(jnp.bfloat16)  # a stand-in for attention, cheap and fused
        h = x + matmul(a, w["o"], s["o"])
        g, u = matmul(h, w["gate"], s["gate"]), matmul(h, w["up"], s["up"])
        return h + matmul((jax.nn.silu(g) * u).astype(jnp.bfloat16), w["down"], s["down"])
    return fn


def bf16(x, w, s):
    return jnp.einsum("bd,df->bf", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def direct_w8(x, w, s):
    from grpo.models.rollout_quant import quantized_matmul

    return quantized_matmul("bd,df->bf", x, w, s, jnp.bfloat16)


def _act_int8(x):
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    sx = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int8), sx


def direct_w8a8(x, w, s):
    xq, sx = _act_int8(x)
    y = jax.lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * sx * s).astype(jnp.bfloat16)


def fp8_w8a8(x, w, s):
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    sx = jnp.where(absmax > 0, absmax / 448.0, 1.0)
    xq = (x / sx).astype(jnp.float8_e4m3fn)
    y = jax.lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * sx * s).astype(jnp.bfloat16)


def qwix_variant(acts):
    import qwix
    from qwix._src.core.qarray import QArray

    def mm(x, w, s):
        qw = QArray(qvalue=w, scale=s[None, :].astype(jnp.bfloat16), zero_point=None, qtype=w.dtype)
        lhs = qwix.quantize(x, jnp.int8, channelwise_axes=(0,)) if acts else x
        return qwix.dot_general(lhs, qw, (((1,), (0,)), ((), ()))).astype(jnp.bfloat16)
    return mm


def analyse(fn, fmt, rows, device):
    mesh = Mesh(np.array([device]), ("x",))
    rep = NamedSharding(mesh, Ps())
    w, s = _weights(fmt)
    put = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), t)  # noqa: E731
    x = jax.ShapeDtypeStruct((rows, D), jnp.bfloat16, sharding=rep)
    compiled = jax.jit(layer(fn)).lower(x, put(w), put(s)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = compiled.as_text()
    weight_bytes = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in w.values())
    # The matmuls as compiled (TPU: `convolution`), with the element types of their operands.
    convs = [line.strip() for line in hlo.splitlines() if " convolution(" in line]
    operand_types = sorted({t for line in convs for t in re.findall(r"\b(s8|bf16|f8e4m3fn|f32|s32)\[", line.split("convolution(")[1])})
    return {
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "flops": float(cost.get("flops", 0.0)),
        "weight_bytes": weight_bytes,
        "fusions": hlo.count(" fusion("),
        # The dot operands' element types as the compiled program has them (s8 = int8 read by the MXU path).
        "matmul_operand_types": operand_types,
        "converts_outside_fusions": len(re.findall(r"^\s*\S+ = \S+ convert\(", hlo, re.M)),
    }


def time_local(fn, fmt, rows, device, repeats=50):
    """Seconds per call of one layer's decode projections on a local accelerator (random
    codes and scales), the fastest of three runs of ``repeats`` calls."""
    import time

    w, s = _weights(fmt)
    rng = np.random.default_rng(0)
    put = lambda a: jax.device_put(jnp.asarray(rng.normal(size=a.shape) * 0.02, jnp.float32).astype(a.dtype)  # noqa: E731
                                   if a.dtype != jnp.int8 else jnp.asarray(rng.integers(-127, 128, a.shape), jnp.int8),
                                   device)
    w, s = jax.tree.map(put, w), jax.tree.map(lambda a: jax.device_put(jnp.full(a.shape, 1e-3, a.dtype), device), s)
    x = jax.device_put(jnp.asarray(rng.normal(size=(rows, D)), jnp.bfloat16), device)
    f = jax.jit(layer(fn))
    jax.block_until_ready(f(x, w, s))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            y = f(x, w, s)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t) / repeats)
    return {"s_per_layer_step": best, "weight_bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in w.values())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v6e:2x4")
    ap.add_argument("--rows", type=int, default=64, help="decode rows per chip")
    ap.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args()
    local = args.topology == "local"  # time on this machine's accelerator instead of compiling for a TPU
    device = jax.devices()[0] if local else topologies.get_topology_desc(platform="tpu",
                                                                        topology_name=args.topology).devices[0]
    variants = {"bf16": (bf16, "bf16"), "direct_w8": (direct_w8, "int8"), "direct_w8a8": (direct_w8a8, "int8"),
                "fp8_w8": (direct_w8, "fp8"), "fp8_w8a8": (fp8_w8a8, "fp8")}
    try:
        import qwix  # noqa: F401

        variants.update({"qwix_w8": (qwix_variant(False), "int8"), "qwix_w8a8": (qwix_variant(True), "int8")})
    except ImportError:
        pass
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",") or k == "bf16"}
    out = {"topology": args.topology, "device_kind": device.device_kind, "rows": args.rows, "variants": {}}
    for name, (fn, fmt) in variants.items():
        try:
            out["variants"][name] = (time_local if local else analyse)(fn, fmt, args.rows, device)
        except Exception as err:  # noqa: BLE001 - a variant libtpu refuses is a finding
            out["variants"][name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    key = "s_per_layer_step" if local else "bytes_accessed"
    base = out["variants"]["bf16"][key]
    for v in out["variants"].values():
        if key in v:
            v[("time" if local else "bytes") + "_vs_bf16"] = round(v[key] / base, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
