"""The ``grpo`` command line.

User errors (:class:`grpo.UserError`) print one paragraph to stderr and exit 2, without
a traceback. Heavy subcommands (run, eval, plan, bench, model, task, export, plot) live in their own
modules and are imported only when used, so ``grpo --help`` and ``grpo plugins list``
never import JAX.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from grpo.core.errors import UserError

# name -> "module:attribute" of a click command or group, imported on first use.
LAZY_COMMANDS: dict[str, str] = {
    "run": "grpo.engine.cli:run",
    "eval": "grpo.engine.cli:evaluate",
    "export": "grpo.engine.cli:export",
    "plot": "grpo.engine.cli:plot",
    "plan": "grpo.engine.cli:plan",
    "model": "grpo.models.cli:model",
    "task": "grpo.plugins.tasks.cli:task",
}
# One-line help for lazy commands, so `grpo --help` lists them without importing them.
LAZY_HELP: dict[str, str] = {
    "run": "Train with a config (the same command on every host).",
    "eval": "Evaluate a run's checkpoint on its eval split.",
    "export": "Write a run's trained policy as a Hugging Face directory.",
    "plot": "Plot reward and throughput of a run.",
    "plan": "Compile a run for a TPU pod without one: memory per chip, fit, roofline.",
    "model": "Inspect models and checkpoints.",
    "task": "Score completions with a task's reward functions.",
    "rollout": "Rollout (sampler) speed: prefill, decode, tokens/s, HBM roofline.",
    "loss": "Loss value+grad speed and compiled memory: jax vs pallas.",
    "memory": "FSDP memory: a buffer sharded over fsdp, or all-gathered.",
    "update": "The update padded vs packed on the same rows of a length profile.",
    "reward": "Reward scoring speed: per completion, threads, batched, overlapped with decode.",
}
LAZY_BENCH: dict[str, str] = {
    "rollout": "grpo.engine.bench.rollout:bench_rollout",
    "loss": "grpo.engine.bench.loss:bench_loss",
    "memory": "grpo.engine.bench.memory:bench_memory",
    "update": "grpo.engine.bench.packed_update:bench_update",
    "reward": "grpo.engine.bench.reward:bench_reward",
}


def _import_command(spec: str) -> click.Command:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


class LazyGroup(click.Group):
    """A click group whose listed subcommands are imported on first use."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            self.add_command(_import_command(self.lazy[name]), name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing help for lazy commands would import them (and JAX); show names only.
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.commands.get(name)
            rows.append((name, cmd.get_short_help_str(60) if cmd is not None else LAZY_HELP.get(name, "")))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class GrpoGroup(LazyGroup):
    """The top-level group: turns UserError into a message and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as err:
            click.echo(f"Error: {err}", err=True)
            ctx.exit(err.exit_code)


@click.group(cls=GrpoGroup, lazy=LAZY_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="grpo-jax", prog_name="grpo")
def cli() -> None:
    """GRPO post-training of LLMs in JAX.

    \b
    grpo run configs/quickstart.yaml     train
    grpo plugins list                    installed plugins
    grpo config validate FILE            check a config
    """


def main(argv: list[str] | None = None) -> None:
    # transformers advises at import that PyTorch is missing; grpo is a JAX program and
    # uses transformers only for configs and tokenizers, so that advice is noise here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cli.main(args=argv, prog_name="grpo")


# --------------------------------------------------------------------------- plugins


@cli.group()
def plugins() -> None:
    """Installed plugins: built-in and third-party."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of a table.")
def plugins_list(as_json: bool) -> None:
    """List every plugin with its kind, provider and status."""
    from grpo.core.plugins import get_plugins

    loaded = get_plugins()
    rows: list[dict[str, Any]] = [
        {"kind": e.kind, "name": e.name, "provider": e.provider, "status": "ok", "description": e.description}
        for e in loaded.entries()
    ]
    for f in loaded.failed:
        rows.append(
            {"kind": f.kind, "name": f.entry_point, "provider": f.provider, "status": "failed", "error": f.error}
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = [("KIND", "NAME", "PROVIDER", "STATUS")]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"failed: {r['error']}"
        table.append((r["kind"] or "?", r["name"], r["provider"], status))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])


# --------------------------------------------------------------------------- config

_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a field, e.g. --set train.steps=10 (the value is parsed as YAML). Repeatable.",
)


@cli.group()
def config() -> None:
    """Validate, show and describe run configs."""


@config.command("validate")
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@_set_option
@click.option("--processes", type=click.IntRange(min=1), help="Also check against this many processes...")
@click.option("--local-devices", type=click.IntRange(min=1), help="...each with this many devices.")
def config_validate(file: str, overrides: tuple[str, ...], processes: int | None, local_devices: int | None) -> None:
    """Check FILE; print `ok`, or every problem and exit 2.

    With --processes and --local-devices the mesh and batch arithmetic are checked for
    that topology too (e.g. a v6e-16 pod is 4 processes x 4 devices), and an asynchronous
    run's split of it into rollout and update devices, as the run checks it.
    """
    from grpo.core.config import load_config, resolve_layout
    from grpo.core.contracts import Topology

    cfg = load_config(file, overrides)
    if (processes is None) != (local_devices is None):
        raise UserError("--processes and --local-devices go together.")
    if processes is not None:
        resolve_layout(cfg, Topology(process_count=processes, local_device_count=local_devices))
        if cfg.train.async_.enabled:  # the split the run would make, by its own check
            from grpo.engine.parallel.split import validate_split

            validate_split(cfg, processes, local_devices)
    if cfg.model.lora is not None:
        _check_lora(cfg)
    click.echo("ok")


def _check_lora(cfg: Any) -> None:
    """LoRA targets and rank against the architecture, when it is known without a
    download (a random preset, a local directory, a hub id with a built-in preset)."""
    from grpo.models.loading import model_architecture
    from grpo.models.lora import resolve_spec

    try:
        arch = model_architecture(cfg.model)
    except UserError:
        return  # `grpo run` checks once the checkpoint is there
    resolve_spec(arch, cfg.model.lora)


@config.command("show")
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@_set_option
def config_show(file: str, overrides: tuple[str, ...]) -> None:
    """Print the resolved config of FILE as YAML, defaults filled in."""
    from grpo.core.config import load_config

    click.echo(load_config(file, overrides).to_yaml(), nl=False)


@config.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the run config (for editors)."""
    from grpo.core.config import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


# --------------------------------------------------------------------------- mesh


@cli.group()
def mesh() -> None:
    """Mesh policies."""


@mesh.command("preview")
@click.option("--policy", required=True, help="Mesh policy name (`grpo plugins list`).")
@click.option("--shape", help='Shape for the explicit policy, e.g. "1,-1,1" or "dp:2,fsdp:-1,tp:1".')
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", help="Other policy options. Repeatable.")
@click.option("--processes", type=click.IntRange(min=1), help="Process (host) count; default: this runtime's.")
@click.option("--local-devices", type=click.IntRange(min=1), help="Devices per process; default: this runtime's.")
@click.option("--expert-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="mesh.expert_parallel: an expert axis of this size carved out of fsdp.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def mesh_preview(
    policy: str, shape: str | None, options: tuple[str, ...], processes: int | None, local_devices: int | None,
    expert_parallel: int, as_json: bool,
) -> None:
    """Resolve a mesh policy for a topology, including one you don't have."""
    from pydantic import ValidationError

    from grpo.core.config import parse_override, validation_problems
    from grpo.core.contracts import Topology
    from grpo.core.plugins import get_plugins

    plugin = get_plugins().get("mesh", policy)
    raw: dict[str, Any] = {}
    for text in options:
        keys, value = parse_override(text)
        raw[".".join(keys)] = value
    if shape is not None:
        raw["shape"] = shape
    try:
        opts = plugin.parse_options(raw)
    except ValidationError as err:
        raise UserError(f"Invalid options for mesh policy {policy!r}:", problems=validation_problems(err, "options", plugin.Options)) from None
    if processes is None and local_devices is None:
        from grpo.engine.parallel.mesh import current_topology

        topology = current_topology()
    elif processes is None or local_devices is None:
        raise UserError("--processes and --local-devices go together (or leave both out to use this runtime's devices).")
    else:
        topology = Topology(process_count=processes, local_device_count=local_devices)
    layout = plugin.resolve(topology, opts)
    try:
        layout = layout.with_expert_axis(expert_parallel)
    except ValueError as err:
        raise UserError(f"{err} (policy {policy!r}).") from None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "policy": policy,
                    "topology": {"processes": topology.process_count, "local_devices": topology.local_device_count},
                    "axis_names": list(layout.axis_names),
                    "shape": layout.shape,
                    "warnings": list(layout.warnings),
                },
                indent=2,
            )
        )
        return
    click.echo(
        f"{policy}: {topology.process_count} process(es) x {topology.local_device_count} device(s) -> "
        + ", ".join(f"{k}={v}" for k, v in layout.shape.items())
    )
    for w in layout.warnings:
        click.echo(f"warning: {w}")


# --------------------------------------------------------------------------- bench


@cli.group(cls=LazyGroup, lazy=LAZY_BENCH)
def bench() -> None:
    """Benchmarks; each prints JSON (speed is measured here, never asserted in tests)."""


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
