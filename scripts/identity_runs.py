"""Bit-identity harness for a restructuring that must not change behaviour (issue 48's
"No behaviour change" limit): six short `grpo run` runs whose learning record must be
bit-identical before and after.

    python scripts/identity_runs.py --out DIR [--root CHECKOUT] [--only NAME ...] [--keep-runs]
    python scripts/identity_runs.py --compare BASE_DIR NEW_DIR
    python scripts/identity_runs.py --list

e.g. ``python scripts/identity_runs.py --out /tmp/id/new`` then
``python scripts/identity_runs.py --compare /work/identity/base /tmp/id/new``. It tests the
checkout given by ``--root`` (default: the one holding this script; any checkout with
``configs/quickstart*.yaml``, e.g. the base commit's): each run is ``python -m
grpo.core.cli run`` in a subprocess in that directory with ``PYTHONPATH`` set to it (the
code there, not an installed ``grpo``), ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS`` fixed per
run (a virtual CPU device count and nothing else; the caller's XLA flags are dropped:
they change XLA:CPU's code generation and so the low bits). Compare runs made on the same
machine: another CPU's code generation may differ in the low bits too. Each run writes
``DIR/NAME.json``:

- ``metrics``: every row of ``metrics.jsonl`` less the keys that measure the machine rather
  than the learning (:func:`is_machine_key`: timings, throughput, memory);
- ``samples``, ``eval``: every row of ``samples.jsonl`` and ``eval.jsonl``, as written;
- ``checkpoint``: the final checkpoint's step, its meta's learning state (step, data
  position, seed, counters; :data:`CHECKPOINT_META`) and a sha256 of each of its
  ``params`` arrays (dtype, shape and bytes);
- ``command``, ``env``, ``seconds``: how it was run and how long it took (not compared).

``--compare A B`` prints, per run, ``identical`` or the first difference (section, row,
step, key, both values), and exits 1 on any difference or a run missing from one side.
The run directories go to ``DIR/runs/NAME`` and are deleted unless ``--keep-runs``.

The runs (all from the shipped configs plus ``--set`` overrides; :data:`RUNS`):

- ``quickstart``: ``configs/quickstart.yaml``, 20 steps, evaluated at 0, 10, 20; 1 device;
- ``tools``: ``configs/quickstart_tools.yaml`` (multi-turn tool calls, PODS down-sampling),
  8 steps, evaluated at 0, 4, 8 on 8 held-out keys; 1 device;
- ``mix``: the quickstart with dynamic sampling (up to 3 rounds; its early steps resample),
  LoRA (rank 4) with dropout 0.1, ``loss.beta`` 0.05, ``train.ppo_epochs`` 2 and two
  micro-batches; 2 devices;
- ``continuous``: the quickstart on ``rollout.engine: continuous`` with 6-token answers,
  4 slots for the 64 rows (rows queue and refill) and no eviction; 2 devices;
- ``async_partial``: the continuous run under ``train.async`` (``max_staleness`` 1,
  ``partial_rollouts``), 2 rollout + 2 update devices;
- ``async_2proc``: the quickstart under ``train.async`` (``max_staleness`` 1) as two
  processes (gloo, a coordinator on a free local port), 4 devices each: process 0 rolls
  out, process 1 updates.

Determinism: every run is deterministic run to run on one machine: at fc54db5 two whole
passes (``/work/identity/base`` and ``base2``) and a third of five runs compared
identical, nothing excluded but the machine keys. The async schedule is fixed (step ``s``
trains the rollout drawn at version ``s - max_staleness``; a partial stream's batch is
the first groups to finish in decode order), not timed by the threads. One pass took
13-15 min on a loaded 2-core machine (92-199 s a run), about half that with light load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "configs/quickstart.yaml"
TOOLS = "configs/quickstart_tools.yaml"

COMMON = ["logging.progress_bar=false", "logging.plot=false", "checkpoint.every_n_steps=0", "checkpoint.at_end=true"]
"""Every run: no progress bar or plot (output only), one checkpoint at the end (hashed)."""

CONTINUOUS = [
    "rollout.engine=continuous", "rollout.max_new_tokens=6", "rollout.num_generations=8",
    # 4 slots for the 64 rows: rows queue and are prefilled as others finish (the default
    # pool holds every slot at the length cap, so no row is evicted: with these short
    # prompts no pool the config accepts is small enough to evict).
    "rollout.continuous={slots: 4, page_size: 4, chunk: 2}",
]

RUNS: dict[str, dict[str, Any]] = {
    "quickstart": {
        "config": QUICKSTART, "devices": 1,
        "sets": ["train.steps=20", "eval.every_n_steps=10"],
    },
    "tools": {
        "config": TOOLS, "devices": 1,
        "sets": ["train.steps=8", "eval.every_n_steps=4", "eval.num_examples=8"],
    },
    "mix": {
        "config": QUICKSTART, "devices": 2,
        "sets": ["train.steps=8", "eval.every_n_steps=0", "rollout.num_generations=8",
                 "train.dynamic_sampling={enabled: true, max_rounds: 3}",
                 "model.lora={rank: 4, alpha: 8, dropout: 0.1}", "loss.beta=0.05",
                 "train.ppo_epochs=2", "train.micro_batch_size=32"],
    },
    "continuous": {
        "config": QUICKSTART, "devices": 2,
        "sets": ["train.steps=6", "eval.every_n_steps=3", "eval.num_examples=8", *CONTINUOUS],
    },
    "async_partial": {
        "config": QUICKSTART, "devices": 4,
        "sets": ["train.steps=6", "eval.every_n_steps=0", *CONTINUOUS,
                 "train.async={enabled: true, max_staleness: 1, partial_rollouts: true}"],
    },
    "async_2proc": {
        "config": QUICKSTART, "devices": 4, "processes": 2,
        "sets": ["train.steps=6", "eval.every_n_steps=0",
                 "train.async={enabled: true, max_staleness: 1, rollout_devices: 4}",
                 "distributed.heartbeat_timeout_s=30", "distributed.initialization_timeout_s=300"],
    },
}


# ------------------------------------------------------------------ what is compared


MACHINE_PREFIXES = ("time/", "throughput/", "memory/")
"""Metric namespaces that measure the machine: seconds, rates, bytes in use."""


def is_machine_key(key: str) -> bool:
    """Whether a metrics key measures the machine (dropped) rather than the learning (kept)."""
    return key.startswith(MACHINE_PREFIXES)


CHECKPOINT_META = ("step", "data_position", "seed", "skipped_nonfinite_steps", "reward_errors")
"""The checkpoint meta fields compared. The rest is the async buffer's and the partial
stream's saved state in their own format (the issue's "one buffer and checkpoint format"
may change it), with a rollout's seconds in it (``rollout_s``); what it holds shows in
the metrics and samples of the steps that train on it."""


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _learning(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not is_machine_key(k)} for row in _rows(path)]


def _checkpoint(run_dir: Path) -> dict | None:
    """The last checkpoint's meta and a sha256 per params array (restored as numpy)."""
    ckpts = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else None
    if not steps:
        return None
    last = ckpts / str(steps[-1])
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only reads arrays back (no TPU probing)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    meta = json.loads((last / "meta" / "metadata").read_text()) if (last / "meta" / "metadata").is_file() else {}
    meta = {k: meta[k] for k in CHECKPOINT_META if k in meta}
    # As numpy arrays: the saved shardings name devices (of other processes) this one lacks.
    reader = ocp.PyTreeCheckpointer()
    shapes = reader.metadata(last / "params").item_metadata
    tree = reader.restore(last / "params",
                          restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes))
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    params = {}
    for path, leaf in leaves:
        a = np.asarray(leaf)
        params[jax.tree_util.keystr(path)] = f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()
    return {"step": steps[-1], "meta": meta, "params": params}


def record(run_dir: Path) -> dict:
    return {"metrics": _learning(run_dir / "metrics.jsonl"), "samples": _rows(run_dir / "samples.jsonl"),
            "eval": _learning(run_dir / "eval.jsonl"), "checkpoint": _checkpoint(run_dir)}


# ------------------------------------------------------------------ running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str, run_dir: Path, root: Path = ROOT) -> tuple[list[list[str]], dict[str, str]]:
    """The argv of each process of run ``name`` (run in ``root``) and the environment they share."""
    spec = RUNS[name]
    sets = [a for s in [*COMMON, *spec["sets"]] for a in ("--set", s)]
    base = [sys.executable, "-m", "grpo.core.cli", "run", spec["config"], "--run-dir", str(run_dir), *sets]
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={spec['devices']}",
           "PYTHONPATH": str(root)}
    n = spec.get("processes", 1)
    if n == 1:
        return [base], env
    port = _free_port()
    return [[*base, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]
            for i in range(n)], env


def run(name: str, out: Path, keep: bool, root: Path = ROOT) -> dict:
    run_dir = out.resolve() / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    argvs, env = command(name, run_dir, root)
    full_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_PLATFORMS")}
    full_env.update(env)
    start = time.time()
    logs = [open(out / f"{name}.{i}.log", "w") for i in range(len(argvs))]
    procs = [subprocess.Popen(a, cwd=root, env=full_env, stdout=log, stderr=subprocess.STDOUT)
             for a, log in zip(argvs, logs)]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    seconds = round(time.time() - start, 1)
    if any(codes):
        raise SystemExit(f"{name}: exit codes {codes}; see {out}/{name}.*.log")
    rec = {"command": [" ".join(a) for a in argvs], "env": env, "seconds": seconds, **record(run_dir)}
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    if not keep:
        shutil.rmtree(run_dir)
    return rec


# ------------------------------------------------------------------ comparing


def first_difference(a: dict, b: dict) -> str | None:
    """The first compared difference between two records, in words; None if identical."""
    for section in ("metrics", "samples", "eval"):
        ra, rb = a.get(section, []), b.get(section, [])
        for i, (x, y) in enumerate(zip(ra, rb)):
            if _same(x, y):
                continue
            step = x.get("step", y.get("step"))
            for key in sorted(set(x) | set(y)):
                if not _same(x.get(key, "<absent>"), y.get(key, "<absent>")):
                    return (f"{section} row {i} (step {step}) key {key!r}: "
                            f"{_short(x.get(key, '<absent>'))} != {_short(y.get(key, '<absent>'))}")
        if len(ra) != len(rb):
            return f"{section}: {len(ra)} rows != {len(rb)} rows"
    ca, cb = a.get("checkpoint"), b.get("checkpoint")
    if not _same(ca, cb):
        if not ca or not cb:
            return f"checkpoint: {_short(ca)} != {_short(cb)}"
        for key in ("step", "meta"):
            if not _same(ca.get(key), cb.get(key)):
                return f"checkpoint {key}: {_short(ca.get(key))} != {_short(cb.get(key))}"
        pa, pb = ca.get("params") or {}, cb.get("params") or {}
        diff = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
        return f"checkpoint params differ: {len(diff)} arrays, first {diff[0]}"
    return None


def _same(x: Any, y: Any) -> bool:
    """Equal as written: NaN equals NaN, 1 differs from 1.0 (the file changed)."""
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def _short(v: Any, n: int = 200) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= n else s[:n] + "..."


def compare(a_dir: Path, b_dir: Path) -> int:
    names = sorted({p.stem for d in (a_dir, b_dir) for p in d.glob("*.json")}, key=lambda n: list(RUNS).index(n)
                   if n in RUNS else len(RUNS))
    bad = 0
    for name in names:
        pa, pb = a_dir / f"{name}.json", b_dir / f"{name}.json"
        if not pa.is_file() or not pb.is_file():
            print(f"{name}: missing in {a_dir if not pa.is_file() else b_dir}")
            bad += 1
            continue
        a, b = json.loads(pa.read_text()), json.loads(pb.read_text())
        diff = first_difference(a, b)
        sizes = f"{len(a['metrics'])} metrics rows, {len(a['samples'])} samples rows, {len(a['eval'])} eval rows"
        print(f"{name}: {'identical' if diff is None else 'DIFFERENT'} ({sizes}){'' if diff is None else ': ' + diff}")
        bad += diff is not None
    return 1 if bad or not names else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="Directory for NAME.json (and logs).")
    parser.add_argument("--root", type=Path, default=ROOT, help="The checkout to test (default: this script's).")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help="Run only these.")
    parser.add_argument("--keep-runs", action="store_true", help="Keep the run directories (OUT/runs/NAME).")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="Compare two --out directories.")
    parser.add_argument("--list", action="store_true", help="Print each run's command and exit.")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.list:
        for name in RUNS:
            argvs, env = command(name, Path("RUN_DIR") / name, args.root.resolve())
            for a in argvs:
                print(f"{name}: " + " ".join(f"{k}={v}" for k, v in env.items()) + " python " + " ".join(a[1:]))
        return 0
    if args.out is None:
        parser.error("--out DIR (or --compare A B, or --list)")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(RUNS):
        rec = run(name, args.out, args.keep_runs, args.root.resolve())
        print(f"{name}: {rec['seconds']} s, {len(rec['metrics'])} steps, {len(rec['samples'])} samples rows, "
              f"{len(rec['eval'])} eval rows", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
