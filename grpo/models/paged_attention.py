"""Moved in 0.2: the paged-attention kernels are in :mod:`grpo.kernels.paged_attention`, the
paged cache in :mod:`grpo.models.layers.paged`. This module warns and forwards for one
minor version."""

from grpo.models._moved import forwarder

__getattr__ = forwarder(__name__, {
    **dict.fromkeys(("BACKENDS", "paged_attention", "paged_attention_gpu", "paged_attention_reference",
                     "paged_attention_tpu", "resolve_backend"), "grpo.kernels.paged_attention"),
    **dict.fromkeys(("PagedKVCache", "PagedSpec", "paged_decode", "write_token"), "grpo.models.layers.paged"),
})
