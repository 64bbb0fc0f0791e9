"""A low-precision rollout in the plan (``rollout.quantization``): the continuous
engine's decode and prefill costed with int8/fp8 weights and KV pages, beside the
unquantized ones, at the same simulated schedule.

What changes on a chip (:mod:`grpo.models.rollout_quant`, :mod:`grpo.models.layers.paged`):

- **weights**: the layer projections (``Wm`` parameters, :func:`~grpo.engine.planning.costs.matmul_params`)
  are read as one byte each instead of the compute dtype's, plus one float32 scale per
  output channel and layer; embedding, head and norms keep their bytes;
- **head** (``rollout.quantization.head: int8``): the output head [D, V] (the embedding,
  when tied) is read as one byte a weight plus one float32 scale per vocabulary row;
- **KV pages**: a cached token's key and value head vectors are one byte an element plus
  one float32 scale each (``E + 4`` bytes instead of ``2 E``), so the same bytes hold
  ``2 E / (E + 4)`` times the rows (1.94 at ``head_dim`` 128);
- FLOPs stay (the matmuls run on the codes converted to the compute dtype; int8 x int8
  would need the activations quantized too, which decode, bound by HBM bandwidth, does not
  gain from: ``scripts/quant_decode_compare.py``).

Each variant's ``bytes_per_decode_step`` is the schedule's bytes (the slowest part of the
pool each step, as its time is counted) over its decode steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

VARIANTS: dict[str, tuple[str, str, str]] = {
    "none": ("none", "none", "none"),
    "int8_weights": ("int8", "none", "none"),
    "int8_weights_kv": ("int8", "int8", "none"),
    "int8_weights_kv_head": ("int8", "int8", "int8"),
}
"""Each costed variant: ``(weights, kv_cache, head)`` as ``rollout.quantization`` names them."""


def scale_params(dims: Any) -> int:
    """Per-output-channel scales of the quantized projections: ``Lyr (H E + 2 Hk E + 2 D + 2 F)``."""
    d = dims
    return d.num_hidden_layers * (d.num_attention_heads * d.head_dim + 2 * d.num_key_value_heads * d.head_dim
                                  + 2 * d.hidden_size + 2 * d.intermediate_size)


def quantized_roof(roof: Any, dims: Any, *, weights: str, kv_cache: str, itemsize: int, tp: int,
                   kv_split: int, prefill: bool = False, head: str = "none") -> Any:
    """``roof`` (a :class:`~grpo.engine.planning.engine.ChipRoof` costed in the compute
    dtype) with the weights, the KV cache and/or the output head quantized
    (``int8``/``fp8``: one byte an element and float32 scales). The head [D, V] is split
    over ``tp`` as the sampler's weights are; its scales are one per vocabulary row."""
    from grpo.engine.planning.costs import matmul_params

    out = roof
    if weights != "none":
        saved = matmul_params(dims) * (itemsize - 1) / tp - 4 * scale_params(dims) / tp
        out = dataclasses.replace(out, weight_bytes=out.weight_bytes - saved)
    if head != "none":
        V, D = dims.vocab_size, dims.hidden_size
        saved = V * D * (itemsize - 1) / tp - 4 * V / tp
        out = dataclasses.replace(out, weight_bytes=out.weight_bytes - saved)
    if kv_cache != "none":
        E = dims.head_dim
        factor = (E + 4) / (E * itemsize)  # per head vector: E codes + a float32 scale, against E * itemsize
        if prefill:  # its prompts' keys and values written
            out = dataclasses.replace(out, row_bytes=out.row_bytes * factor)
        else:
            out = dataclasses.replace(out, token_bytes=out.token_bytes * factor)
    return out


def config_roofs(config: Any, dims: Any, dec: Any, pre: Any, figures: dict[str, Any]) -> tuple[Any, Any]:
    """The decode and prefill roofs of the config's own ``rollout.quantization``."""
    q = config.rollout.quantization
    kw = dict(weights=q.weights, kv_cache=q.kv_cache, head=q.head, itemsize=figures["itemsize"], tp=figures["tp"],
              kv_split=figures["kv_split"])
    return quantized_roof(dec, dims, **kw), quantized_roof(pre, dims, prefill=True, **kw)


def variants_section(dims: Any, *, dec: Any, pre: Any, figures: dict[str, Any], run: Callable[..., dict[str, Any]],
                     static_rows_bytes: float, page_size: int, pool_rows: Callable[..., float],
                     steady: Callable[..., list[dict[str, Any]]]) -> dict[str, Any]:
    """Each of :data:`VARIANTS` at the simulated schedule: weight and KV bytes, bytes per
    decode step, decode and prefill rooflines, page-pool rows in the static cache's bytes
    and the steady state's best valid tokens/s (partial rollouts). ``dec``/``pre``: the
    unquantized roofs; ``run(decode=, prefill=)`` the schedule's seconds with them;
    ``pool_rows(page_bytes=)``, ``steady(decode=, prefill=)`` as the engine section's."""
    out: dict[str, Any] = {}
    for name, (w, kv, hd) in VARIANTS.items():
        kw = dict(weights=w, kv_cache=kv, head=hd, itemsize=figures["itemsize"], tp=figures["tp"],
                  kv_split=figures["kv_split"])
        d, p = quantized_roof(dec, dims, **kw), quantized_roof(pre, dims, prefill=True, **kw)
        secs = run(decode=d, prefill=p)
        # Bytes as seconds at 1 byte/s and no compute or ICI: the same schedule's bytes.
        nbytes = run(decode=dataclasses.replace(d, peak=float("inf"), bw=1.0, ici_s=0.0), prefill=p)["decode_s"]
        best = [x for x in steady(decode=d, prefill=p) if x["fits_pool"]]
        out[name] = {
            "weights": w, "kv_cache": kv, "head": hd, "weight_bytes_per_chip": d.weight_bytes, "kv_bytes_per_token": d.token_bytes,
            "bytes_per_decode_step": nbytes / max(secs["decode_steps"], 1),
            "decode_roofline_s": secs["decode_s"], "prefill_roofline_s": secs["prefill_s"],
            "pool_rows": pool_rows(page_bytes=page_size * d.token_bytes),
            "steady_state_valid_tokens_per_s": max((x["valid_tokens_per_s"] for x in best), default=None),
        }
    base = out["none"]
    for v in out.values():
        v["bytes_ratio"] = v["bytes_per_decode_step"] / base["bytes_per_decode_step"]
        v["decode_ratio"] = v["decode_roofline_s"] / base["decode_roofline_s"] if base["decode_roofline_s"] else None
        v["pool_rows_ratio"] = v["pool_rows"] / base["pool_rows"]
    return out


def quantization_headline(report: dict[str, Any]) -> None:
    """Each variant's step roofline (the report's step with its rollout's decode and
    prefill replaced by the variant's) and valid tokens/s (packed under the profile), in
    ``report["rollout_engine"]["quantization"]``."""
    en = report.get("rollout_engine") or {}
    section = en.get("quantization")
    if not section or "decode_roofline_s" not in en:
        return
    own = en["decode_roofline_s"] + en["prefill_roofline_s"]
    pk = report.get("packing")
    for v in section.values():
        delta = v["decode_roofline_s"] + v["prefill_roofline_s"] - own
        v["roofline_step_s"] = report["roofline_step_s"] + delta
        if pk:
            step = pk["roofline_step_packed_s"] + delta
            v["roofline_step_packed_s"] = step
            v["valid_tokens_per_s_packed"] = pk["valid_tokens_per_step"] / step
    base = section["none"]
    for v in section.values():
        v["step_ratio"] = v["roofline_step_s"] / base["roofline_step_s"]


__all__ = ["VARIANTS", "config_roofs", "quantization_headline", "quantized_roof", "scale_params", "variants_section"]
