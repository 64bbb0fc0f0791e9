"""Built-in attention kernels (``model.attention``): ``xla``, ``splash`` (TPU) and
``pallas_gpu`` (GPU). ``auto`` takes :data:`grpo.core.contracts.AUTO_ATTENTION`'s pick for the platform.

Why Pallas on GPU rather than cuDNN: cuDNN's fused attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) expresses padding only as
per-row lengths from the start of the row (right padding); our prompts are left-padded to
end at the same slot, so the mask would have to be a materialised ``[rows, 1, T, T]``
bias — the very tensor a blocked kernel exists to avoid. The Pallas GPU kernel takes
segment ids, which cover any padding exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from grpo.core.contracts import AUTO_ATTENTION, AttentionPlugin, PluginOptions, auto_attention
from grpo.core.hookspecs import hookimpl

LANES = 128  # Mosaic's lane width (grpo.kernels.attention.LANES; no JAX import here)
MAX_TILE = 2048 * 2048
"""The largest q block x kv block a splash kernel's tiles fit in TPU VMEM (measured)."""


class XlaAttention(AttentionPlugin):
    name = "xla"
    description = "The model's masked jax.nn.dot_product_attention: [rows, heads, T, T] float32 scores."

    def build(self, options: Any, *, platform: str) -> Any:
        return None


class SplashOptions(PluginOptions):
    block_q: int = Field(512, description="Query block of the forward kernel (a multiple of 128).")
    block_kv: int = Field(512, description="Key/value block of the forward kernel (a multiple of 128).")
    block_kv_compute: int = Field(512, description="Key/value sub-block per matmul (divides block_kv).")
    block_q_dkv: int = Field(512, description="Query block of the dK/dV backward kernel.")
    block_kv_dkv: int = Field(512, description="Key/value block of the dK/dV backward kernel.")
    block_kv_dkv_compute: int = Field(512, description="Key/value sub-block of the dK/dV kernel.")
    block_q_dq: int = Field(512, description="Query block of the dQ backward kernel (unused when fused).")
    block_kv_dq: int = Field(512, description="Key/value block of the dQ backward kernel (unused when fused).")
    fused_backward: bool = Field(False, description="One backward kernel for dQ, dK and dV.")

    @field_validator(
        "block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
        "block_q_dq", "block_kv_dq",
    )
    @classmethod
    def _lanes(cls, v: int) -> int:
        if v < LANES or v % LANES:
            raise ValueError(
                f"must be a positive multiple of {LANES} (Mosaic tiles the sequence in {LANES}-lane blocks)"
            )
        return v

    @model_validator(mode="after")
    def _fits(self):
        problems = []
        for block, compute in (("block_kv", "block_kv_compute"), ("block_kv_dkv", "block_kv_dkv_compute")):
            if getattr(self, block) % getattr(self, compute):
                problems.append(f"{compute}={getattr(self, compute)} must divide {block}={getattr(self, block)}")
        kernels = [("block_q", "block_kv"), ("block_q_dkv", "block_kv_dkv")]
        if not self.fused_backward:
            kernels.append(("block_q_dq", "block_kv_dq"))
        for q, kv in kernels:
            a, b = getattr(self, q), getattr(self, kv)
            if a * b > MAX_TILE:
                problems.append(
                    f"{q}={a} x {kv}={b} is over {MAX_TILE:,} elements: Mosaic refuses the kernel's tiles on TPU "
                    "(CompileTimeScopedVmemOom; measured on v6e with libtpu: 2048 x 2048 and 4096 x 1024 compile, "
                    "2048 x 4096 does not); use smaller blocks (default 512 x 512)"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class _PallasPlugin(AttentionPlugin):
    """A Pallas kernel of :mod:`grpo.kernels.attention`: compiled on its own platforms,
    interpreted on CPU; the options are the kernel's fields."""

    kernel: ClassVar[str]  # class name in grpo.kernels.attention
    interpret_platforms = ("cpu",)

    def build(self, options: Any, *, platform: str) -> Any:
        from grpo.kernels import attention

        return getattr(attention, self.kernel)(**options.model_dump(), interpret=platform not in self.platforms)


class SplashAttentionPlugin(_PallasPlugin):
    name = "splash"
    description = (
        "Splash attention (Pallas/Mosaic, TPU): causal block sparsity, padding by segment ids, GQA; "
        "forward and backward kernels keep no [T, T] scores."
    )
    Options = SplashOptions
    platforms = ("tpu",)
    kernel = "SplashAttention"


class PallasGpuOptions(PluginOptions):
    block_q: int = Field(64, description="Query block of the forward kernel (a power of two >= 16).")
    block_k: int = Field(64, description="Key/value block of the forward kernel (a power of two >= 16).")
    block_q_bwd: int = Field(32, description="Query block of the backward kernels.")
    block_k_bwd: int = Field(32, description="Key/value block of the backward kernels.")

    @field_validator("block_q", "block_k", "block_q_bwd", "block_k_bwd")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v < 16 or v & (v - 1):
            raise ValueError("must be a power of two >= 16 (Triton's tile sizes)")
        return v


class PallasGpuAttentionPlugin(_PallasPlugin):
    name = "pallas_gpu"
    description = (
        "Flash attention in Pallas/Triton (GPU): causal, padding by segment ids, forward and backward; "
        "KV heads repeated to the query heads."
    )
    Options = PallasGpuOptions
    platforms = ("gpu",)
    kernel = "PallasGpuAttention"


@hookimpl
def register_attention(register):
    register(XlaAttention())
    register(SplashAttentionPlugin())
    register(PallasGpuAttentionPlugin())


__all__ = [
    "AUTO_ATTENTION",
    "PallasGpuAttentionPlugin",
    "SplashAttentionPlugin",
    "XlaAttention",
    "auto_attention",
]
