"""One program compiled for the plan: the TPU compiler's verdict on it
(:func:`compile_program`: its memory, the compiler's cost figures, its optimized HLO and
collectives, or the compiler's error, and its lowering and compile times) and the report's
entry of it (:func:`program_entry`: peak bytes beside the resident state, counted costs,
communication); the report's ``compile`` section (:func:`compile_report`: programs, the
shapes a run compiles of them, :func:`run_shapes`, and the TPU compiler's time).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from grpo.engine.planning.costs import Cost, communication


@dataclasses.dataclass
class ProgramResult:
    name: str
    memory: dict[str, int] | None
    xla: dict[str, float]
    error: str | None
    takes: tuple[str, ...]  # resident state it takes as arguments
    hlo: str | None = None  # the optimized HLO text
    hlo_source: str | None = None  # "xla_dump" or "as_text" (see :func:`compile_program`)
    collectives: list[Any] | None = None  # hlo.Collective, None without HLO
    lower_s: float | None = None  # tracing and lowering to StableHLO (Python, this host)
    compile_s: float | None = None  # the TPU compiler (libtpu) on this host, to its verdict: wall time
    compile_cpu_s: float | None = None  # ... and this process's CPU time (every thread; steadier on a busy host)


_SIZE = re.compile(r"\(([\d.]+)([KMGT])\)")


def first_size(message: str) -> int | None:
    """The first ``(12.34G)`` size in a compiler OOM message, in bytes."""
    m = _SIZE.search(message)
    if not m:
        return None
    return int(float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)])


def compiler_text(err: Exception) -> str:
    """The compiler's message of ``err``, its first 20 non-empty lines (4000 characters at most)."""
    text = str(err).strip() or type(err).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[:20])[:4000]


def read_dump(directory: str) -> str | None:
    """The optimized HLO text XLA dumped into ``directory`` (one module), or None."""
    import glob
    import os

    files = sorted(glob.glob(os.path.join(directory, "*.after_optimizations.txt")))
    if not files:
        return None
    with open(files[-1]) as f:
        return f.read()


def compile_program(name: str, lower: Callable, takes: tuple[str, ...]) -> ProgramResult:
    """Compile one program; its memory, the compiler's cost figures and its optimized
    HLO (for the collectives).

    The HLO comes from XLA's own dump (``xla_dump_to`` + ``xla_dump_hlo_as_text`` as
    per-compile ``compiler_options``, which a compile-only TPU client honours; the
    ``*.after_optimizations.txt`` file), else from ``compiled.as_text()``: with jax
    0.10.2 + libtpu 0.0.52, ``as_text()`` raises for the update program
    (``RET_CHECK ... async-update instruction should have 1 operands but sees 3``).
    """
    import shutil
    import tempfile
    import time

    import jax

    # The persistent compilation cache stays off: a compile-only TPU client writes entries
    # it cannot read back (jax 0.10.2, libtpu 0.0.52: a warning per program, "PjRtCompiler
    # must be constructed with a Client to call DeserializeLoadedExecutable"), and a hit
    # would skip the compile whose HLO dump the plan reads and whose time it reports.
    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    dump = tempfile.mkdtemp(prefix="grpo-plan-hlo-")
    t0 = time.perf_counter()
    t1 = c1 = None
    try:
        lowered = lower()
        t1, c1 = time.perf_counter(), time.process_time()
        try:
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        except Exception as err:  # a compiler that refuses the dump options
            if "xla_dump" not in str(err):
                raise
            t1, c1 = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - the compiler's verdict is the plan's result
        shutil.rmtree(dump, ignore_errors=True)
        t2, c2 = time.perf_counter(), time.process_time()
        return ProgramResult(name, None, {}, compiler_text(err), takes, lower_s=(t1 or t2) - t0,
                             compile_s=None if t1 is None else t2 - t1, compile_cpu_s=None if c1 is None else c2 - c1)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_on)
    times = {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1, "compile_cpu_s": time.process_time() - c1}
    hlo_text, source = read_dump(dump), "xla_dump"
    shutil.rmtree(dump, ignore_errors=True)
    if hlo_text is None:
        try:
            hlo_text, source = compiled.as_text(), "as_text"
        except Exception:  # noqa: BLE001 - no HLO: the plan reports no communication
            hlo_text, source = None, None
    ops = None
    if hlo_text:
        from grpo.engine.planning import hlo

        ops = hlo.collectives(hlo_text)
    ma = compiled.memory_analysis()
    arg, out, alias, temp = (ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                             ma.temp_size_in_bytes)
    code = ma.generated_code_size_in_bytes
    memory = {
        "argument_bytes": int(arg), "output_bytes": int(out), "alias_bytes": int(alias),
        "temp_bytes": int(temp), "generated_code_bytes": int(code),
        "program_bytes": int(arg + out - alias + temp + code),
    }
    xla: dict[str, float] = {}
    try:
        ca = compiled.cost_analysis()
        if isinstance(ca, (list, tuple)):
            ca = ca[0] if ca else {}
        xla = {k: float(v) for k, v in (ca or {}).items() if k in ("flops", "bytes accessed")}
    except Exception:  # noqa: BLE001 - cost analysis is optional
        pass
    return ProgramResult(name, memory, xla, None, takes, hlo_text, source, ops, **times)


def program_entry(r: ProgramResult, cost: Cost, *, resident: int, state: dict[str, int], chip: Any,
                  slice_of: list[int]) -> dict[str, Any]:
    """One program's report: its memory (``peak_bytes``: the program's bytes plus the
    ``resident`` state beside it; after a compiler OOM a lower bound from its message),
    its counted costs and its communication."""
    entry: dict[str, Any] = {
        "argument_bytes": None, "output_bytes": None, "alias_bytes": None, "temp_bytes": None,
        "generated_code_bytes": None, "program_bytes": None, "resident_bytes": resident,
        "peak_bytes": None,
        "flops": cost.flops, "bytes_accessed": cost.bytes, "roofline_s": cost.roofline_s,
        "xla_flops": r.xla.get("flops"), "xla_bytes_accessed": r.xla.get("bytes accessed"),
        "compiler_error": r.error,
    }
    entry.update(communication(r.collectives, r.hlo_source, cost, chip, slice_of))
    if r.memory is not None:
        entry.update({k: v for k, v in r.memory.items()})
        entry["peak_bytes"] = r.memory["program_bytes"] + resident
    elif r.error is not None:
        need = first_size(r.error) if "memory" in r.error.lower() or "hbm" in r.error.lower() else None
        if need is not None:
            # The message counts the program's temporaries; its state arguments
            # (parameters, optimizer state) come on top: a lower bound on the peak.
            entry["peak_bytes"] = need + sum(state[t] for t in r.takes) + resident
    return entry


def run_shapes(programs: Any, names: list[str]) -> dict[str, int]:
    """How many shapes of each program in ``names`` a run can compile: the packed passes
    one per bin layout ``per`` and head width ``K`` of it, pack and unpack one per ``per``;
    the static engine's rollout and eval programs one per prompt bucket; any other one."""
    from grpo.engine.planning.packed import PACKED_PROGRAMS
    from grpo.engine.rollout.prompts import default_buckets
    from grpo.engine.training.packing import head_widths

    config = programs.config
    out = dict.fromkeys(names, 1)
    if getattr(programs, "packing", False):
        schedules = programs.schedule_shapes()
        for name in names:
            if name in PACKED_PROGRAMS:
                out[name] = sum(len(head_widths(slots=per * config.bin_length)) for per in schedules)
            elif name in ("pack", "unpack"):
                out[name] = len(schedules)
    if config.rollout.engine == "static":
        buckets = len(config.rollout.prompt_buckets or default_buckets(config.rollout.max_prompt_length))
        for name in names:
            if name.removeprefix("eval_") in ("prefill", "decode", "append"):
                out[name] = buckets
    return out


def compile_report(results: list[ProgramResult], shapes: dict[str, int]) -> dict[str, Any]:
    """The plan's ``compile`` section: the programs it compiled (each once, at its largest
    shape), the shapes a run compiles of them (``shapes``: :func:`run_shapes`), and the TPU
    compiler's time on this host: wall and CPU time for the programs compiled, and CPU time
    estimated for every shape (each timed as its program's compiled one)."""
    by = {r.name: {"shapes": shapes.get(r.name, 1), "lower_s": r.lower_s, "compile_s": r.compile_s,
                   "compile_cpu_s": r.compile_cpu_s} for r in results}
    timed = [v for v in by.values() if v["compile_s"] is not None]
    return {
        "programs": len(by),
        "shapes": sum(v["shapes"] for v in by.values()),
        "lower_s": sum(v["lower_s"] or 0.0 for v in by.values()),
        "compile_s": sum(v["compile_s"] for v in timed),
        "compile_cpu_s": sum(v["compile_cpu_s"] for v in timed),
        "run_compile_cpu_s": sum(v["compile_cpu_s"] * v["shapes"] for v in timed),
        "by_program": by,
    }


__all__ = ["ProgramResult", "compile_program", "compile_report", "program_entry", "run_shapes"]
