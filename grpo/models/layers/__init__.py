"""One decoder layer of :class:`grpo.models.decoder.Decoder`, room by room: module-level
pure functions of a frozen :class:`~grpo.models.layers.context.LayerContext` (what is
fixed for one call of the model) and the layer's parameters ``p`` (name -> one layer's
slice of the stacked arrays). :mod:`grpo.models.decoder` composes them into a layer and
scans it over the stack.

- ``context``: :class:`LayerContext` and :func:`constrain` (activations to their logical
  axes on the mesh).
- ``projection``: :func:`project`, a projection with QLoRA dequantization and the LoRA
  term (adapter dropout included), never merged.
- ``norms``: :func:`rms_norm`.
- ``rope``: RoPE frequencies (:func:`rope_inv_freq`, transformers' float32 order), tables
  and rotation.
- ``attention``: the attention block: norm, q/k/v and RoPE (:func:`qkv`), the cache write
  and attention (:func:`attend`: dense XLA, a blocked kernel of :mod:`grpo.kernels.attention`
  per device under ``shard_map``, or paged), the dense :class:`KVCache`.
- ``paged``: the paged KV cache (:class:`PagedKVCache`, :class:`PagedSpec`) and one decode
  step's write and attention per device (:func:`paged_decode`, the kernels of
  :mod:`grpo.kernels.paged_attention`).
- ``mlp``: the MLP block (:func:`mlp_block`).
- ``moe``: the mixture-of-experts block (:func:`moe_block`, in place of the MLP for a
  family with experts): softmax top-k routing, router replay, dropless grouped-matmul
  experts, and the layer's routing statistics.
- ``expert_parallel``: the experts split over the expert mesh axis ``ep``, tokens
  dispatched and combined by all-to-all under ``shard_map`` (:func:`ep_experts_forward`).

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.kernels``, ``grpo.models.quant``,
``grpo.models.rollout_quant``.
Not the decoder, which builds on the layers.
"""
