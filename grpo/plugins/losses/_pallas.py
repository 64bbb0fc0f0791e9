"""The ``pallas`` loss's kernel configuration: its options and the platform compiled for
-> a :class:`~grpo.kernels.head_logprobs.KernelConfig` (default blocks per backend, the
refusals of block sizes a backend cannot tile, the TPU VMEM budget), and the compile-only
opaque kernels of ``grpo bench loss --opaque-kernels``. The kernel itself, with its
custom VJP, is :mod:`grpo.kernels.head_logprobs`.

The platform compiled for is the mesh's (set by the engine while it traces the loss, see
:func:`grpo.core.contracts.compiling_for`), not ``jax.default_backend()``: ``grpo plan``
compiles Mosaic kernels for a TPU mesh on a CPU host.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from grpo.kernels.head_logprobs import KernelConfig, fused_token_logprobs

_OPAQUE = [False]


@contextlib.contextmanager
def opaque_kernels():
    """Within this context, ``resolve_config`` returns opaque (compile-only) configs."""
    _OPAQUE.append(True)
    try:
        yield
    finally:
        _OPAQUE.pop()


GPU_BACKENDS = ("gpu", "cuda", "rocm")
DEFAULTS = {  # backend -> (block_t, block_v, block_d)
    "tpu": (256, 512, 0),
    "gpu": (64, 128, 64),
    "cpu": (256, 512, 0),
}


# Scoped VMEM the grid kernels may request (v5e/v6e have 128 MiB per core).
VMEM_CAP = 100 << 20


def _grid_vmem_estimate(bt: int, bv: int, hidden_size: int, dtype) -> int:
    """VMEM bytes of the largest grid kernel (dW): double-buffered H and W blocks, the f32
    accumulator and the output block, and the f32 [bt, bv] logits temporaries."""
    item = jnp.dtype(dtype).itemsize
    return 2 * (bt * hidden_size + hidden_size * bv) * item + hidden_size * bv * (4 + 2 * item) + 8 * bt * bv * 4


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def resolve_config(options, *, dtype, hidden_size: int, backend: str | None = None) -> KernelConfig:
    """Options + backend -> KernelConfig; raises ``UserError`` naming the bad field."""
    from grpo.core.errors import UserError

    from grpo.core.contracts import target_platform

    # The platform compiled for: explicit, else the mesh's (set by the engine while it
    # traces the loss), else this process's default backend.
    backend = backend or target_platform() or jax.default_backend()
    kind = "gpu" if backend in GPU_BACKENDS else backend
    if kind not in DEFAULTS:
        raise UserError(f"loss.impl=pallas does not support the {backend!r} backend (TPU, GPU and CPU only).")
    interpret = options.interpret if options.interpret is not None else kind == "cpu"
    if kind == "cpu" and not interpret:
        raise UserError("loss.options.interpret=false: on CPU Pallas kernels only run in interpret mode.")
    schedule = options.schedule if options.schedule != "auto" else ("loop" if kind == "gpu" else "grid")
    if not interpret and kind == "gpu" and schedule == "grid":
        raise UserError(
            "loss.options.schedule=grid needs sequential grid steps and VMEM scratch (TPU, interpret); "
            "on GPU use schedule=loop (or auto)."
        )
    if not interpret and kind == "tpu" and schedule == "loop":
        raise UserError(
            "loss.options.schedule=loop keeps whole operands un-tiled (a GPU/Triton layout); "
            "on TPU use schedule=grid (or auto)."
        )
    bt0, bv0, bd0 = DEFAULTS["gpu" if schedule == "loop" else kind]
    bt = options.block_t or bt0
    bv = options.block_v or bv0
    bd = options.block_d or bd0 or 64
    problems: list[str] = []
    if schedule == "loop":
        # Triton tensors must have power-of-two sizes; tl.dot needs every dim >= 16.
        for field, val in (("block_t", bt), ("block_v", bv), ("block_d", bd)):
            if not _pow2(val) or val < 16:
                problems.append(f"loss.options.{field}={val} must be a power of two >= 16 for the loop (GPU) schedule")
    if kind == "tpu" and not interpret:
        # Mosaic tiles the last two dims of every block by (sublane, 128 lanes); 16-bit
        # dtypes pack two rows per sublane.
        sub = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
        if bt % sub:
            problems.append(f"loss.options.block_t={bt} must be a multiple of {sub} on TPU for {jnp.dtype(dtype).name}")
    if problems:
        raise UserError("The pallas loss cannot tile these block sizes:", problems=problems)
    vmem = None
    if kind == "tpu" and not interpret and schedule == "grid":
        est = _grid_vmem_estimate(bt, bv, hidden_size, dtype)
        if est > VMEM_CAP:
            # Mosaic refuses these at compile time (CompileTimeScopedVmemOom); measured for
            # v6e with D=2048 bf16: 512 x 2048 (est. 84 MiB) compiles, 1024 x 4096
            # (est. 232 MiB) does not.
            raise UserError(
                "The pallas loss cannot tile these block sizes:",
                problems=[f"loss.options.block_t={bt} x block_v={bv} needs about {est >> 20} MiB of TPU VMEM at "
                          f"hidden size {hidden_size} ({jnp.dtype(dtype).name}), more than the "
                          f"{VMEM_CAP >> 20} MiB the kernels may use; use smaller blocks (default 256 x 512)"],
            )
        vmem = int(min(max(est * 3 // 2, 32 << 20), VMEM_CAP))
    return KernelConfig(block_t=bt, block_v=bv, block_d=bd, schedule=schedule, interpret=bool(interpret),
                        backend=kind, vmem_limit_bytes=vmem, opaque=_OPAQUE[-1])


def default_block_sizes(backend: str) -> tuple[int, int, int]:
    return DEFAULTS["gpu" if backend in GPU_BACKENDS else backend]


__all__ = ["default_block_sizes", "fused_token_logprobs", "opaque_kernels", "resolve_config"]
