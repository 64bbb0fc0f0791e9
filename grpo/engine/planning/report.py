"""The plan's report: the attention each program runs, and the text ``grpo plan`` prints
(``--json`` prints the report itself)."""

from __future__ import annotations

from typing import Any

from grpo.core.config import RunConfig

WHOLE_SEQUENCE_PROGRAMS = ("prefill", "reference", "policy_logprobs", "update", "eval_prefill")
"""Programs whose attention is ``model.attention``'s kernel; the rest (decode) use XLA's."""


# The programs that run the model's attention (the step's other programs move arrays).
ATTENDING_PROGRAMS = WHOLE_SEQUENCE_PROGRAMS + ("decode", "append", "eval_decode", "eval_append")


def attention_report(config: RunConfig, programs: list[str]) -> dict[str, Any]:
    """``model.attention`` as resolved for TPU, and the attention each program runs."""
    from grpo.core.config import attention_plugin

    name, _, options = attention_plugin(config.model, "tpu")
    return {
        "name": name,
        "options": options.model_dump(mode="json"),
        "programs": {p: (name if p in WHOLE_SEQUENCE_PROGRAMS else "xla") for p in programs if p in ATTENDING_PROGRAMS},
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"{rep['topology']} ({rep['topology_raw']}): {rep['processes']} process(es) x {rep['devices_per_process']} "
        f"{rep['device_kind']}; mesh " + ", ".join(f"{k}={v}" for k, v in rep["mesh"].items()),
        f"shape: {rep['shape']['sequences_per_step']} sequences/step"
        + (f" (of {rep['shape']['rollout_sequences_per_step']} rolled out)"
           if rep["shape"]["rollout_sequences_per_step"] != rep["shape"]["sequences_per_step"] else "")
        + f", micro-batch {rep['shape']['micro_batch_size']}, "
        f"prompt {rep['shape']['prompt_length']} + {rep['shape']['max_new_tokens']} new tokens, loss "
        f"{rep['shape']['loss']}, remat {rep['shape']['remat']}, params {rep['shape']['param_dtype']}",
        "state per device (GiB): " + ", ".join(
            f"{k} {_gib(v)}" for k, v in rep["state_bytes_per_device"].items()
            if v or k not in ("merged_projections", "rollout_parameters")),
    ]
    ro = rep.get("rollout_layout")
    if ro:
        how = ("resharded once per step into mesh " + ", ".join(f"{k}={v}" for k, v in ro["mesh"].items())
               if ro.get("resharded") else "on the training layout (weights gathered per token)")
        lines.append(f"rollout: style {rep.get('rollout_style')}, tensor_parallel {ro['tensor_parallel']}, {how}")
    att = rep.get("attention")
    if att:
        by: dict[str, list[str]] = {}
        for prog, kernel in att["programs"].items():
            by.setdefault(kernel, []).append(prog)
        lines.append("attention: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in by.items()))
    lora = rep.get("lora")
    if lora:
        base = f"{rep['shape']['param_dtype'] if lora['base_quantization'] == 'none' else lora['base_quantization']} base"
        lines.append(
            f"LoRA r={lora['rank']} alpha={lora['alpha']:g} on {', '.join(lora['targets'])}; {base}: "
            f"{rep['trainable_params'] / 1e6:,.2f} M trainable "
            f"({100 * rep['trainable_params'] / max(1, rep['trainable_params'] + rep['frozen_params']):.2f}%), "
            f"{rep['frozen_params'] / 1e6:,.1f} M frozen; per device: adapters {_gib(lora['adapter_bytes'])} GiB, "
            f"base {_gib(lora['base_bytes'])} GiB"
        )
    elif "trainable_params" in rep:
        lines.append(f"full fine-tuning: {rep['trainable_params'] / 1e6:,.1f} M trainable parameters")
    lines += [
        "",
        f"{'PROGRAM':<12} {'ARGS':>7} {'OUT':>7} {'TEMP':>7} {'RESIDENT':>9} {'PEAK':>7}  {'TFLOP':>8} "
        f"{'GB READ':>8} {'COMM GB':>8} {'ICI':>8} {'ROOFLINE':>9}",
    ]
    for name, p in rep["programs"].items():
        comm = p.get("ici_bytes")
        lines.append(
            f"{name:<12} {_gib(p['argument_bytes']):>7} {_gib(p['output_bytes']):>7} {_gib(p['temp_bytes']):>7} "
            f"{_gib(p['resident_bytes']):>9} {_gib(p['peak_bytes']):>7}  {p['flops'] / 1e12:>8.2f} "
            f"{p['bytes_accessed'] / 1e9:>8.2f} "
            + (f"{comm / 1e9:>8.2f} {p['ici_s']:>7.3f}s" if comm is not None else f"{'-':>8} {'-':>8}")
            + f" {p['roofline_s']:>8.3f}s"
        )
    lines.append("(GiB per device; TFLOP and GB per device; COMM: GB one chip receives per program run, ICI: that "
                 "over half its ICI bandwidth)")
    dec = rep["programs"].get("decode", {})
    if dec.get("collective_bytes_per_step") is not None:
        total = sum(dec["collective_bytes_per_step"].values())
        kinds = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in dec["collective_bytes_per_step"].items()
                          if v and v >= 1e-3 * total)
        lines.append(
            f"decode per generated token: {total / 1e9:.3f} GB per chip "
            f"({kinds or 'none'}), ICI {dec['ici_s_per_step'] * 1e3:.2f} ms"
        )
    lines += [a2a] if (a2a := all_to_all_text(rep["programs"])) else []
    lines.append("")
    verdict = "fits" if rep["fits"] else "DOES NOT FIT"
    margin = rep["margin_bytes"]
    lines.append(
        f"peak {_gib(rep['peak_bytes_per_device'])} GiB of {_gib(rep['hbm_bytes_per_device'])} GiB HBM per device: "
        f"{verdict}" + (f" (margin {_gib(margin)} GiB)" if margin is not None else "")
    )
    lines.append(f"roofline lower bound of one step: {rep['roofline_step_s']:.2f} s"
                 + (f" ({rep['roofline_step_no_comm_s']:.2f} s without communication)"
                    if "roofline_step_no_comm_s" in rep else ""))
    if rep.get("step_rollout"):
        lines.append("  rollout costed as " + step_rollout_text(rep["step_rollout"]))
    ev = rep.get("eval")
    if ev:
        whole = (f", of one evaluation ({ev['batches']} batches): {rep['roofline_eval_s']:.2f} s"
                 if ev["batches"] else "")
        lines.append(
            f"evaluation every {ev['every_n_steps']} steps: batches of {ev['prompts_per_batch']} prompts (padded to "
            f"{ev['padded_prompts_per_batch']}) x k={ev['k']} = {ev['rows_per_batch']} rows, KV cache "
            f"{_gib(ev['kv_cache_bytes'])} GiB per device; roofline of one batch {ev['roofline_batch_s']:.2f} s{whole}"
        )
    if rep.get("compile"):
        lines.append(format_compile(rep["compile"], rep["topology"]))
    if rep.get("packing"):
        lines += format_packing(rep["packing"], rep["hbm_bytes_per_device"], rollout=rep.get("step_rollout"))
    if rep.get("rollout_engine"):
        lines += format_engine(rep["rollout_engine"])
    if rep.get("not_planned"):
        np_ = rep["not_planned"]
        lines.append(f"rollout engine {np_['rollout_engine']}: not planned ({np_['why']}); left out: {np_['left_out']}")
    if rep.get("async"):
        lines += format_async(rep["async"])
    if rep["compiler_error"]:
        lines.append("compiler: " + rep["compiler_error"])
    for w in rep.get("mesh_warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def format_compile(c: dict[str, Any], topology: str) -> str:
    """The ``compile`` section as one line: programs, shapes, and the TPU compiler's time."""
    return (f"compiles: {c['programs']} programs, {c['shapes']} shapes a run can compile; the TPU compiler (libtpu) "
            f"took {c['compile_cpu_s']:.1f} s of CPU ({c['compile_s']:.1f} s wall) for the {c['programs']} on this "
            f"host, lowering {c['lower_s']:.1f} s; about {c['run_compile_cpu_s']:.0f} s of CPU for all {c['shapes']} "
            f"shapes (each timed as its program's largest; a {topology} host's CPU differs)")


def all_to_all_text(programs: dict) -> str | None:
    """One line of the all-to-all bytes a chip receives (expert parallelism's dispatch and
    combine), per program run and per generated token for decode; None without any."""
    def a2a(p: dict, key: str = "collective_bytes") -> float:
        return float((p.get(key) or {}).get("all-to-all") or 0.0)

    runs = [f"{name} {a2a(p) / 1e9:.3g}" for name, p in programs.items() if a2a(p)]
    if not runs:
        return None
    dec = programs.get("decode", {})
    token = f"; decode per generated token {a2a(dec, 'collective_bytes_per_step') / 1e9:.3g}" if a2a(dec) else ""
    return f"all-to-all (experts' dispatch and combine), GB per chip per program run: {', '.join(runs)}{token}"


def step_rollout_text(sr: dict[str, Any]) -> str:
    """How the step roofline costed the rollout (the plan's ``step_rollout``)."""
    text = f"{sr['engine']} engine: {sr['description']}"
    if sr["costed_as"] == "schedule":
        text += (f", {sr['decode_s']:.3f} + {sr['prefill_s']:.3f} s in place of the programs' "
                 f"{sr['programs_decode_s']:.3f} + {sr['programs_prefill_s']:.3f} s "
                 f"(step {sr['programs_step_s']:.2f} s at the cap)")
    return text


def format_engine(en: dict[str, Any]) -> list[str]:
    """The continuous engine's section (page pool, and the simulated schedule under a
    length profile), as text."""
    lines = [f"rollout engine {en['engine']}: {en['slots']} slots, page pool {_gib(en['pool_bytes_per_device'])} GiB "
             f"per device (pages of {en['page_size']} tokens)"]
    if "decode_steps" in en:
        lines.append(
            f"  length profile, scheduled on the host: {en['decode_steps']} decode steps ({en['chunks']} chunks, "
            f"{en['prefills']} prefills, {en['evictions']} evictions), {en['slot_steps']:,} slot-steps for "
            f"{en['valid_tokens']:,} valid tokens; static: {en['static_decode_steps']} steps, "
            f"{en['static_slot_steps']:,} slot-steps; pool peak {en['peak_pages']} of {en['pool_pages']} pages "
            f"({_gib(en['peak_pool_bytes_per_device'])} GiB per device)")
    lp = en.get("largest_pool")
    if lp:
        lines.append(f"  largest pool that fits beside the rest: pool_pages {lp['pool_pages']:,} per device "
                     f"({_gib(lp['pool_bytes'])} GiB; set rollout.continuous.pool_pages to it)")
    if "decode_roofline_s" in en:
        ratio = f" = {en['decode_ratio']:.2f}x" if en["decode_ratio"] is not None else ""
        lines.append(
            f"  synchronous decode roofline: continuous {en['decode_roofline_s']:.3f} s (+ prefill "
            f"{en['prefill_roofline_s']:.3f} s), static {en['static_decode_roofline_s']:.3f} s{ratio}")
        cr = en["concurrent_rows"]
        lines.append(f"  concurrent rows in the static cache's {_gib(cr['static_cache_bytes_per_device'])} GiB per "
                     f"device: static {cr['static']}, pool {cr['pool']:.0f} at the profile's lengths "
                     f"({cr['ratio']:.2f}x)")
        best = min(en["slots_sweep"], key=lambda x: x["decode_roofline_s"] + x["prefill_roofline_s"], default=None)
        if best:
            lines.append(f"  best slots for the synchronous step: {best['slots']} (decode "
                         f"{best['decode_roofline_s']:.3f} s, {best['decode_ratio']:.2f}x static)")
        st = en.get("steady_state_best")
        if st:
            lines.append(
                f"  steady state (partial rollouts), {st['slots']} slots: {st['s_per_valid_token'] * 1e6:.2f} us per "
                f"valid token (decode {st['decode_s_per_valid_token'] * 1e6:.2f}, prefill "
                f"{st['prefill_s_per_valid_token'] * 1e6:.2f}), {st['valid_tokens_per_s']:,.0f} valid tokens/s")
    return lines


def format_async(a: dict[str, Any]) -> list[str]:
    """The ``async`` section (pipelined step against the synchronous one), as text."""
    ws = a["weight_sync"]
    lines = [
        "",
        f"async: rollout on {a['rollout_devices']} devices (mesh " + ", ".join(f"{k}={v}" for k, v in
                                                                          a["rollout_mesh"].items())
        + f"), update on {a['update_devices']} (mesh " + ", ".join(f"{k}={v}" for k, v in a["update_mesh"].items())
        + f"); peaks {_gib(a['rollout_peak_bytes'])} / {_gib(a['update_peak_bytes'])} GiB: "
        + ("fit" if a["fits"] else "DO NOT FIT"),
        f"  weight sync {ws['received_bytes_per_chip'] / 1e9:.2f} GB in / {ws['sent_bytes_per_chip'] / 1e9:.2f} GB out "
        f"per chip, {ws['seconds'] * 1e3:.1f} ms" + (f" over {ws['link'].upper()}" if ws.get("link") else "")
        + (f" (LoRA: the adapters alone, {100 * ws['share']:.2f}% of the weights' "
           f"{ws['full_bytes_per_chip'] / 1e9:.2f} GB; the base moves once)" if ws.get("moves") == "adapters" else ""),
        f"  rollout side costed as the {a.get('rollout_engine')} engine's "
        + ("simulated schedule" if a.get("rollout_costed_as") == "schedule" else "programs (every row to the cap)"),
        f"  step roofline: synchronous {a['synchronous_step_s']:.3f} s; pipelined max(rollout {a['rollout_s']:.3f}, "
        f"update {a['update_s']:.3f} + sync) = {a['pipelined_step_s']:.3f} s ({a['ratio']:.2f}x)",
    ]
    if "pipelined_partial_step_s" in a:
        lines.append(f"  with partial rollouts ({a['rollout_slots']} slots, steady state): rollout "
                     f"{a['rollout_partial_s']:.3f} s, pipelined {a['pipelined_partial_step_s']:.3f} s "
                     f"({a['partial_ratio']:.2f}x)")
    if "valid_tokens_per_s" in a:
        lines.append(f"  valid tokens/s: synchronous {a['valid_tokens_per_s_synchronous']:,.0f}, pipelined "
                     f"{a['valid_tokens_per_s']:,.0f}"
                     + (f", with partial rollouts {a['valid_tokens_per_s_partial']:,.0f}"
                        if "valid_tokens_per_s_partial" in a else ""))
    return lines


def format_packing(pk: dict[str, Any], hbm: int, rollout: dict[str, Any] | None = None) -> list[str]:
    """The ``packing`` section of a plan under a length profile, as text (``rollout``: the
    plan's ``step_rollout``, how the step rooflines cost the rollout)."""
    prof = pk["profile"]
    q = prof["quantiles"]
    scheds = sorted({(d["micro_batches"], d["per"]) for d in pk["draws"]})
    mb = pk["micro_batch"]
    lines = [
        "",
        f"lengths {prof['name']}: completions mean {prof['mean_completion']:.0f} of {prof['cap']} (p50 "
        f"{q['p50']:.0f}, p90 {q['p90']:.0f}, {100 * prof['at_cap']:.1f}% at the cap); prompts: {prof['prompts']}",
        f"packed: at most {pk['bins']} bins of {pk['bin_length']} tokens ({pk['bins_per_device']} per device; "
        f"{len(pk['draws'])} drawn steps used {min(d['bins_used'] for d in pk['draws'])}-"
        f"{max(d['bins_used'] for d in pk['draws'])} bins, scheduled as micro-batches x bins per device: "
        f"{', '.join(f'{m}x{p}' for m, p in scheds)}; at most {pk['max_bins_per_device']} per device), "
        f"efficiency {100 * pk['efficiency']:.1f}%; at most {pk['compile_bound']} shapes compiled per pass "
        f"({pk['bin_shapes']} bin layouts x their head widths)",
        f"{'PASS':<16} {'PADDED':>9} {'PACKED':>9} {'RATIO':>6}",
    ]
    for name, p in pk["passes"].items():
        lines.append(f"{name:<16} {p['padded_roofline_s']:>8.3f}s {p['packed_roofline_s']:>8.3f}s {p['ratio']:>6.2f}")
    lines += [
        f"step roofline: padded {pk['roofline_step_padded_s']:.2f} s, packed {pk['roofline_step_packed_s']:.2f} s; "
        f"valid tokens/s: padded {pk['valid_tokens_per_s_padded']:,.0f}, packed {pk['valid_tokens_per_s_packed']:,.0f} "
        f"({pk['valid_tokens_per_step']:,.0f} valid tokens per step)"
        + (f"; rollout: the {rollout['engine']} engine's "
           + ("simulated schedule" if rollout["costed_as"] == "schedule" else "programs at the cap")
           if rollout else ""),
        f"update micro-batch: {mb['bins_per_device']} bins x {mb['bin_length']} per device = "
        f"{mb['sequences_per_device']:.1f} sequences at {mb['sequences_per_bin']:.2f} per bin; "
        f"update peak {_gib(pk['update_peak_bytes'])} GiB ({pk['update_program']}); packed plan peak "
        f"{_gib(pk['peak_bytes_per_device'])} of {_gib(hbm)} GiB: {'fits' if pk['fits'] else 'DOES NOT FIT'}",
    ]
    if pk.get("update_compiler_error"):
        lines.append("packed update compiler: " + pk["update_compiler_error"])
    return lines


__all__ = ["WHOLE_SEQUENCE_PROGRAMS", "all_to_all_text", "attention_report", "format_async", "format_engine", "format_packing", "format_report",
           "step_rollout_text"]
