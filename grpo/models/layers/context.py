"""What every decoder layer reads besides its own parameters (:class:`LayerContext`), and
activations constrained to their logical axes on the mesh (:func:`constrain`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from grpo.sharding import fit_sharding


def constrain(
    x: jax.Array, names: Sequence[str], mesh: Mesh | None, rules: Sequence[tuple[str, Any]]
) -> jax.Array:
    """``x`` constrained to the logical axes ``names`` under the activation ``rules`` on
    ``mesh`` (unchanged without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, fit_sharding(x.shape, names, mesh, dict(rules)))


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What every decoder layer reads besides its own parameters, fixed for one call of
    :class:`grpo.models.decoder.Decoder` (built by it; the layer functions are pure in it)."""

    config: Any  # the DecoderConfig (grpo.models.decoder; not imported here: no cycle)
    dtype: Any  # the compute dtype
    mesh: Mesh | None
    rules: tuple[tuple[str, Any], ...]  # activation rules (Decoder.activation_rules)
    quantization: str  # how the base projections are stored: none | nf4 | int8
    lora: Any  # the LoraSpec of the adapters in use; None: no adapters, or switched off
    dropout_keys: jax.Array | None  # [B, T, 2] each token's row's adapter-dropout key data; None: no dropout
    positions: jax.Array  # [B, T] int32 RoPE positions (a token's place in its sequence)
    cos: jax.Array  # [B, T, head_dim] float32 RoPE tables
    sin: jax.Array  # [B, T, head_dim]
    kernel: Any  # the blocked attention kernel of this call, or None (dense attention)
    dense_impl: Any  # jax.nn.dot_product_attention's implementation (dense attention)
    mask: jax.Array | None  # [B, 1, T, S] bool, dense attention only
    segment_ids: jax.Array | None  # [B, S] int32 (1 real token, 0 padding), kernel only
    write_index: jax.Array | None  # scalar int32: the cache slot of the first token
    # A decode step over a paged cache: (page_table [B, max_pages], lengths [B], live [B],
    # its PagedSpec); None: the dense cache (or none).
    paged: Any = None
    # What the call asks of mixture-of-experts layers (grpo.models.layers.moe.MoeCall:
    # replayed experts, the tokens the routing statistics count); None: nothing.
    moe: Any = None

    def constrain(self, x: jax.Array, names: Sequence[str]) -> jax.Array:
        return constrain(x, names, self.mesh, self.rules)


__all__ = ["LayerContext", "constrain"]
