"""The quickstart's held-out curve, as the README's table:

    python scripts/quickstart_curve.py [--steps 800] [--suite-xla]

runs ``configs/quickstart.yaml`` (evaluated every 50 steps from step 0, no checkpoints,
no plot) and prints the table of held-out greedy pass@1 in the README's format (steps
whose values repeat merged into ranges, e.g. ``450-650``), then one line saying what it
was measured on and how long it took. ``--suite-xla`` runs it under the test suite's
XLA setup (8 virtual CPU devices, its compile flags), whose numerics the suite's
``test_quickstart_learns_held_out_sums`` checks the README's early columns against:
XLA:CPU's code generation changes the low bits, and 800 steps of RL amplify them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Mapping

SUITE_XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)
"""tests/conftest.py's XLA flags (tests/_xla.py; a test keeps the two the same)."""

ROW_LABEL = "held-out greedy pass@1 (11)"
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def format_table(curve: Mapping[int, float]) -> str:
    """``{step: pass@1}`` -> the README's markdown table; consecutive steps with the same
    value share one column (``450-650``)."""
    steps = sorted(curve)
    columns: list[tuple[str, float]] = []
    start = prev = steps[0]
    for step in steps[1:] + [None]:
        if step is not None and round(curve[step], 2) == round(curve[start], 2):
            prev = step
            continue
        columns.append((str(start) if start == prev else f"{start}-{prev}", curve[start]))
        if step is not None:
            start = prev = step
    widths = [max(len(name), 4) for name, _ in columns]
    head = f"| {'step':<{len(ROW_LABEL)}} | " + " | ".join(n.ljust(w) for (n, _), w in zip(columns, widths)) + " |"
    rule = f"|{'-' * (len(ROW_LABEL) + 2)}|" + "|".join("-" * (w + 2) for w in widths) + "|"
    row = f"| {ROW_LABEL} | " + " | ".join(f"{v:.2f}".ljust(w) for (_, v), w in zip(columns, widths)) + " |"
    return "\n".join([head, rule, row])


def parse_table(text: str) -> dict[int, float]:
    """The README's table (the first whose row is :data:`ROW_LABEL`) -> ``{step: pass@1}``,
    every step of a ``a-b`` column (at the 50-step eval cadence) given its value."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == ROW_LABEL:
            head = [c.strip() for c in lines[i - 2].strip().strip("|").split("|")][1:]
            curve = {}
            for name, value in zip(head, cells[1:]):
                first, _, last = name.partition("-")
                for step in range(int(first), int(last or first) + 1, 50):
                    curve[step] = float(value)
            return curve
    raise ValueError(f"no table row {ROW_LABEL!r}")


def quickstart_curve(steps: int, config: str | os.PathLike = CONFIG) -> tuple[dict[int, float], float]:
    """``({step: held-out pass@1}, wall seconds)`` of the quickstart run for ``steps``."""
    import tempfile

    from grpo.core.config import load_config
    from grpo.engine.runs.metrics import read_eval
    from grpo.engine.trainer import Trainer

    cfg = load_config(config, [
        f"train.steps={steps}", "logging.progress_bar=false", "logging.plot=false", "checkpoint.at_end=false",
        "checkpoint.every_n_steps=0", "eval.every_n_steps=50"])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        Trainer(cfg, d).run()
        rows = read_eval(d)
    return {int(r["step"]): float(r["eval/pass@1"]) for r in rows}, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python scripts/quickstart_curve.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800, help="Training steps (the quickstart's 800).")
    parser.add_argument("--suite-xla", action="store_true", help="The test suite's XLA setup (see the module docstring).")
    parser.add_argument("--config", default=str(CONFIG), help="The config (default configs/quickstart.yaml).")
    args = parser.parse_args(argv)
    if args.suite_xla:
        if "jax" in sys.modules:
            raise SystemExit("--suite-xla must be set before JAX starts: run this module as a script")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SUITE_XLA_FLAGS).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    curve, seconds = quickstart_curve(args.steps, args.config)
    import jax

    print(format_table(curve))
    print(f"\n{args.steps} steps in {seconds:.0f} s on {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{os.cpu_count()} CPU cores{' (the test suite XLA setup)' if args.suite_xla else ''}")


if __name__ == "__main__":  # pragma: no cover
    main()
