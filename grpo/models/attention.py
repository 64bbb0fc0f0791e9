"""Moved in 0.2: the attention kernels are in :mod:`grpo.kernels.attention` (also
``grpo.reference_attention``), the sharding helpers in :mod:`grpo.models.layers.attention`.
This module warns and forwards for one minor version."""

from grpo.models._moved import forwarder

_KERNELS = "grpo.kernels.attention"
__getattr__ = forwarder(__name__, {
    **dict.fromkeys(("AttentionFn", "LANES", "PallasGpuAttention", "SplashAttention", "fit_block",
                     "reference_attention", "self_check"), _KERNELS),
    **dict.fromkeys(("head_specs", "sharded"), "grpo.models.layers.attention"),
})
