"""``grpo run``, ``grpo eval``, ``grpo export``, ``grpo plot`` and ``grpo plan`` (imported
lazily by the core CLI); run, eval and export are thin layers over :mod:`grpo.api`."""

from __future__ import annotations

import logging
import sys

import click

from grpo.core.errors import UserError

_set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a config field, e.g. --set train.steps=10 (YAML-parsed). Repeatable.",
)


@click.command("run")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=True, path_type=str))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=str),
              help="Run directory; resumes when it holds a checkpoint. Default: runs/<name>-<timestamp>.")
@click.option("--resume", is_flag=True,
              help="Continue the latest run of CONFIG in runs/: its newest runs/<name>-<timestamp> with a checkpoint "
                   "made by a config that defines the same run (model, task, data, seed, algorithm; train.steps, "
                   "eval, checkpoint and logging settings may change). A run of that name made by another config "
                   "stops with the differing fields.")
@click.option("--resume-changed", is_flag=True,
              help="Continue the run (--resume's, or --run-dir's) even when this config defines another one: "
                   "the new config is recorded as config.step-N.yaml beside the config.yaml that trained the "
                   "earlier steps. Implies --resume without --run-dir.")
@_set_option
@click.option("--coordinator-address", help="host:port of process 0 (sets distributed.mode=explicit).")
@click.option("--num-processes", type=click.IntRange(min=1), help="Process count (distributed.num_processes).")
@click.option("--process-id", type=click.IntRange(min=0), help="This process's id (distributed.process_id).")
def run(config_path, run_dir, resume, resume_changed, overrides, coordinator_address, num_processes,
        process_id) -> None:
    """Train with the config in CONFIG (the same command on every host)."""
    from grpo import api

    flags = run_flags(overrides, coordinator_address, num_processes, process_id)
    api.load_config(config_path, flags)  # a bad config fails before logging and JAX start
    api.configure_logging()
    from grpo.engine.parallel import distributed
    from grpo.engine.parallel.exchange import RemoteFailure
    from grpo.engine.trainer import Interrupted

    try:
        resume = resume or (resume_changed and not run_dir)
        result = api.train(config_path, overrides=flags, run_dir=run_dir, resume=resume, resume_changed=resume_changed,
                           _cli=True)
    except RemoteFailure as err:  # the other process of a two-process async run failed: its output has the traceback
        click.echo(f"Error: {err}. The other process's output says where.", err=True)
        sys.exit(1)
    except Interrupted as stop:
        if stop.is_main:
            click.echo(f"Interrupted after step {stop.step}; checkpoint saved. Resume with: "
                       f"{resume_command(config_path, stop.run_dir, overrides)}", err=True)
        distributed.leave(stop.exit_code)
    import jax

    if jax.process_index() == 0:
        click.echo(
            f"Done: {result.summary['steps']} steps in {result.run_dir} "
            f"(last reward/mean {result.metrics.get('reward/mean', float('nan')):.4f})"
        )
        compiled = result.summary.get("compile")
        if compiled:  # not for a run that was already done
            total, where = compiled["total"], compiled["cache_dir"]
            cache = f"{total['cache_hits']} loaded from the cache in {where}" if where else "compilation cache off"
            click.echo(f"Compiled {total['count']} programs in {total['seconds']:.1f} s ({cache})")
    distributed.leave(0)


def resume_command(config_path: str, run_dir: str, overrides) -> str:
    """The command that continues ``run_dir``: the same config and the same ``--set`` flags
    (a resume without them would continue under other settings, e.g. fewer train.steps)."""
    import shlex

    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    return f"grpo run {shlex.quote(config_path)} --run-dir {shlex.quote(str(run_dir))}{sets}"


def run_flags(overrides, coordinator_address=None, num_processes=None, process_id=None) -> list[str]:
    """The ``--set`` overrides ``grpo run``'s options amount to, in the order applied."""
    flags = list(overrides)
    if coordinator_address is not None:
        flags += ["distributed.mode=explicit", f"distributed.coordinator_address={coordinator_address}"]
    if num_processes is not None:
        flags.append(f"distributed.num_processes={num_processes}")
    if process_id is not None:
        flags.append(f"distributed.process_id={process_id}")
    return flags


@click.command("eval")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--step", type=int, help="Checkpoint step (default: the latest).")
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def evaluate(run_dir, step, overrides, as_json) -> None:
    """Evaluate RUN_DIR's checkpoint on its eval split with its eval settings (--set eval.k=8
    etc. change them); prints the metrics an evaluation during training logs."""
    import json as _json

    from grpo import api

    api.configure_logging()
    metrics = api.evaluate(run_dir, step=step, overrides=list(overrides))
    if as_json:
        click.echo(_json.dumps(metrics, indent=2, default=float))
        return
    for key, value in metrics.items():
        click.echo(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--step", type=int, help="Checkpoint step (default: the latest).")
@click.option(
    "--adapter", is_flag=True,
    help="LoRA runs: write only the adapters, as a PEFT directory (adapter_config.json + "
    "adapter_model.safetensors) for peft.PeftModel.from_pretrained. Default: merged full weights.",
)
def export(run_dir, out_dir, step, adapter) -> None:
    """Write RUN_DIR's trained policy as a Hugging Face directory OUT_DIR (LoRA runs: the
    adapters merged into the base, or with --adapter the adapters alone in PEFT format)."""
    from grpo import api

    path = api.export(run_dir, out_dir, step=step, adapter=adapter)
    click.echo(f"Exported to {path}")


@click.command("plot")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--output", type=click.Path(dir_okay=False, path_type=str), help="PNG path (default RUN_DIR/metrics.png).")
def plot(run_dir, output) -> None:
    """Plot reward and throughput over steps from RUN_DIR/metrics.jsonl."""
    from grpo.engine.runs import rundir
    from grpo.engine.runs.metrics import plot_run

    if not rundir.readable_run_dir(run_dir):
        raise UserError(f"{run_dir} is not a run directory.")
    click.echo(str(plot_run(run_dir, output, weights=_reward_weights(run_dir))))


def _reward_weights(run_dir: str) -> dict[str, float] | None:
    """The run's reward weights, from its saved config; None when they cannot be had
    (no config.yaml, or a task whose rewards were Python objects of the process that ran it)."""
    from grpo.core.config import load_config, select_plugins
    from grpo.engine.rollout.scoring import run_reward_weights
    from grpo.engine.runs import identity, rundir

    try:
        if not rundir.readable_run_dir(run_dir, need="config.yaml"):
            return None
        config = load_config(identity.latest_config(run_dir, None)[1])
        task = select_plugins(config)["task"]
        return run_reward_weights(config, task.plugin, task.options)
    except Exception:  # noqa: BLE001 - the plot then draws the rewards unweighted, and says so
        return None


@click.command("plan")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=True, path_type=str))
@click.option("--topology", required=True, metavar="NAME",
              help="TPU pod: v6e-8, v6e-16, v6e-64, v5e-8, v5p-8, v4-8, ... or a raw topology such as v6e:2x4.")
@_set_option
@click.option("--search", "search_field", metavar="FIELD",
              help="Find the largest value that fits: train.micro_batch_size or train.prompts_per_step; or the best "
              "asynchronous split: train.async.rollout_devices.")
@click.option("--hbm-limit", type=click.FloatRange(min=0, min_open=True), metavar="GIB",
              help="Plan against this much HBM per chip (GiB) instead of all of it, to keep headroom.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--dump-hlo", type=click.Path(file_okay=False, path_type=str), metavar="DIR",
              help="Write each compiled program's optimized HLO text to DIR/<program>.hlo.txt.")
@click.option("--lengths", metavar="PROFILE",
              help="Completion-length profile: a built-in name (gsm8k-qwen25-3b-v6e8), a file with one length "
              "(tokens) a line, or a run's samples.jsonl. Adds the packed bins, the packed passes' roofline and "
              "valid tokens/s beside the padded figures; --search then searches the packed fit.")
def plan(config_path, topology, overrides, search_field, hbm_limit, as_json, dump_hlo, lengths) -> None:
    """Compile CONFIG's programs for a TPU pod (no TPU needed): memory per chip, fit,
    communication, roofline.

    The programs `grpo run` executes (prefill, decode, the reference pass when beta > 0,
    the update) are compiled by the TPU compiler (libtpu) on abstract parameters and
    optimizer state in their real shardings. Nothing is downloaded or allocated. A plan
    that does not fit is a successful plan (exit status 0).
    """
    import json as _json

    from grpo.core.config import load_config
    from grpo.engine.planning.tpu import parse_topology, require_libtpu

    config = load_config(config_path, list(overrides))
    topo = parse_topology(topology)  # an unknown name fails before anything heavy
    profile = None
    if lengths is not None:
        from grpo.engine.planning.profiles import load_profile

        profile = load_profile(lengths)
    require_libtpu()
    for noisy in ("absl", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from grpo.engine.planning.plan import Planner
    from grpo.engine.planning.report import format_report
    from grpo.engine.planning.search import search

    planner = Planner(topo, hbm_bytes=int(hbm_limit * (1 << 30)) if hbm_limit else None, dump_hlo=dump_hlo)
    if search_field:
        result = search(config_path, list(overrides), search_field, planner, lengths=profile)
        report = dict(result["plan"])
        report["search"] = {k: result[k] for k in ("field", "max_fitting", "tried")}
        if "best" in result:
            report["search"]["best"] = result["best"]
    else:
        from grpo.engine.planning.reward_plan import add_model_rewards

        report = add_model_rewards(planner.plan(config, profile), planner, config)  # task.model_rewards
    if as_json:
        click.echo(_json.dumps(report, indent=2))
        return
    click.echo(format_report(report))
    if "model_rewards" in report:
        from grpo.engine.planning.reward_plan import format_model_rewards

        click.echo(format_model_rewards(report["model_rewards"]))
    if search_field:
        s = report["search"]
        if "best" in s:
            tried = ", ".join(f"{v}: {r:.2f} s" if isinstance(r, float) else f"{v}: {r}" for v, r in s["tried"])
            click.echo(f"search {s['field']}: best split = {s['best']} (pipelined step per split: {tried})")
            return
        tried = ", ".join(f"{v}: {'fits' if ok else 'no'}" for v, ok in s["tried"])
        click.echo(f"search {s['field']}: largest that fits = {s['max_fitting']} (tried {tried})")
