"""The planner's cost model (``grpo.engine.planning.costs``): what a mixture-of-experts
model costs per token (issue 54)."""

from __future__ import annotations

from grpo.engine.planning.costs import matmul_params
from grpo.models.presets import preset_config


def test_a_mixture_of_experts_costs_its_active_experts():
    """Issue 54: a token multiplies by its k experts and the router, not by every expert:
    the matmul parameters are the active parameters less the embedding, the head and the
    norms (counted independently by the config)."""
    for name in ("qwen3-30b-a3b", "tiny-moe"):
        c = preset_config(name)
        head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        norms = c.num_hidden_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size
        assert matmul_params(c) == c.active_params() - c.vocab_size * c.hidden_size - head - norms
