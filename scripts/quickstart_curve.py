"""The quickstart's held-out curve, as the README's table:

    python scripts/quickstart_curve.py [--steps 800]
    python scripts/quickstart_curve.py --check RUN_DIR

runs ``configs/quickstart.yaml`` (evaluated every 50 steps from step 0, no checkpoints,
no plot) and prints the table of held-out greedy pass@1 in the README's format (steps
whose values repeat merged into ranges, e.g. ``450-650``), then one line saying what it
was measured on and how long it took. The device count and XLA's compile flags change
the low bits, and 800 steps of RL amplify them, so it runs as the README command does (one
CPU device, default flags); the suite's ``test_quickstart_learns_held_out_sums`` runs the
first 350 steps the same way and asserts this table's columns exactly.

The machine does not: ``import grpo`` sizes XLA:CPU's thread pool from the device count
(not the machine's cores) and turns off the CPU-dependent code paths
(:mod:`grpo.core.cpu`), so an x86-64 machine with AVX2 gives this curve bit for bit
(before, a machine with another core count or CPU gave another curve: six columns off).
Measured: the quickstart on one core (``taskset -c 0``) and on two gave the same 800
metrics rows; without that set-up, one core, two and a pool of 16 threads gave three
different losses from step 5.

``--check RUN_DIR`` reads a finished ``grpo run configs/quickstart.yaml`` run's
``eval.jsonl`` and compares it with the README's table: CI runs it on the README's
quickstart, so a change to the numerics updates the table or fails. It allows
:data:`TOLERANCE` per column (one held-out prompt of 11, plus rounding), for what is not
pinned: a CPU without AVX2, another architecture (ARM), another jaxlib. A changed curve
(another seed, learning rate or loss) moves several columns by more than that and fails.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Mapping

ROW_LABEL = "held-out greedy pass@1 (11)"
TOLERANCE = 1 / 11 + 0.006
"""The largest difference --check allows between a run's held-out pass@1 and the README's
at any evaluated step: one of the 11 held-out prompts, plus the table's rounding."""
README = Path(__file__).resolve().parents[1] / "README.md"
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


def check_run(run_dir: str | os.PathLike, readme: str | os.PathLike = README) -> list[str]:
    """The steps where ``run_dir``'s held-out pass@1 (its ``eval.jsonl``) is further than
    :data:`TOLERANCE` from the README's table, as lines for people (empty: they agree).
    Reads JSON only: it runs in the quickstart's base install."""
    import json

    table = parse_table(Path(readme).read_text())
    path = Path(run_dir) / "eval.jsonl"
    if not path.exists():
        return [f"{path} does not exist: not a finished quickstart run"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = {int(r["step"]): float(r["eval/pass@1"]) for r in rows}
    problems = [f"step {step}: the README's table says {value:.2f}, the run {run[step]:.2f}"
                for step, value in sorted(table.items()) if step in run and abs(run[step] - value) > TOLERANCE]
    missing = sorted(set(table) - set(run))
    if missing:
        problems.append(f"the run has no evaluation at steps {missing} of the README's table")
    return problems


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
    parser.add_argument("--config", default=str(CONFIG), help="The config (default configs/quickstart.yaml).")
    parser.add_argument("--check", metavar="RUN_DIR", help="Compare a finished quickstart run with the README's table.")
    args = parser.parse_args(argv)
    if args.check:
        problems = check_run(args.check)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            raise SystemExit("The quickstart's held-out curve no longer matches README.md's table: regenerate it "
                             "with `python scripts/quickstart_curve.py` (800 steps, one device) and update the table.")
        print(f"{args.check}: held-out pass@1 agrees with README.md's table (within {TOLERANCE:.3f} a step)")
        return
    curve, seconds = quickstart_curve(args.steps, args.config)
    import jax

    print(format_table(curve))
    print(f"\n{args.steps} steps in {seconds:.0f} s on {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{os.cpu_count()} CPU cores")


if __name__ == "__main__":  # pragma: no cover
    main()
