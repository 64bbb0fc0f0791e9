"""One program compiled for the plan: the TPU compiler's verdict on it
(:func:`compile_program`: its memory, the compiler's cost figures, its optimized HLO and
collectives, or the compiler's error) and the report's entry of it (:func:`program_entry`:
peak bytes beside the resident state, counted costs, communication).
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

    import jax

    # A compile-only TPU client can neither read nor usefully write the persistent
    # compilation cache of this host's backend.
    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    dump = tempfile.mkdtemp(prefix="grpo-plan-hlo-")
    try:
        lowered = lower()
        try:
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        except Exception as err:  # a compiler that refuses the dump options
            if "xla_dump" not in str(err):
                raise
            compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - the compiler's verdict is the plan's result
        shutil.rmtree(dump, ignore_errors=True)
        return ProgramResult(name, None, {}, compiler_text(err), takes)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_on)
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
    return ProgramResult(name, memory, xla, None, takes, hlo_text, source, ops)


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


__all__ = ["ProgramResult", "compile_program", "program_entry"]
