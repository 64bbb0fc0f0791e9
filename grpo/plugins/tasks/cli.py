"""``grpo task``: work with tasks outside training (score saved completions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import click

from grpo.core.errors import UserError

_MAX_PROBLEMS = 10


@click.group()
def task() -> None:
    """Tasks: data, prompts and rewards."""


def _task_options(plugin: Any, overrides: tuple[str, ...]) -> Any:
    from pydantic import ValidationError

    from grpo.core.config import apply_overrides, parse_override, validation_problems

    raw: dict[str, Any] = {}
    for text in overrides:
        keys, _value = parse_override(text)  # validates the KEY=VALUE shape and the YAML
        if keys[:2] == ["task", "options"]:
            keys = keys[2:]
        elif keys[:1] == ["options"]:
            keys = keys[1:]
        elif keys[0] == "task":
            raise UserError(
                f"--set {text!r}: only the task's options can be set here, as task.options.KEY=VALUE "
                "(the task itself is the NAME argument)."
            )
        if not keys:
            raise UserError(f"--set {text!r}: name an option, e.g. --set task.options.correct_mode=flexible")
        apply_overrides(raw, [".".join(keys) + "=" + text.partition("=")[2]])
    try:
        return plugin.parse_options(raw)
    except ValidationError as err:
        raise UserError(
            f"Invalid options for task {plugin.name!r}:", problems=validation_problems(err, "task.options", plugin.Options)
        ) from None


def _open_input(path: str) -> TextIO:
    if path == "-":
        return sys.stdin
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {path!r} is not a file.")
    try:
        return p.open(encoding="utf-8")
    except OSError as err:
        raise UserError(f"--input {path!r} could not be opened: {err}") from None


def _read(plugin: Any, options: Any, path: str) -> tuple[list[dict], list[dict], int]:
    """(records, examples, skipped) from a jsonl file; UserError listing malformed lines."""
    from grpo.plugins.tasks._common import UnparseableAnswer

    prepare = plugin.prepare_example
    skip_unparseable = bool(getattr(options, "skip_unparseable", False))
    records: list[dict] = []
    examples: list[dict] = []
    problems: list[str] = []
    skipped = 0
    stream = _open_input(path)
    try:
        for lineno, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                problems.append(f"line {lineno}: not valid JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(record, dict):
                problems.append(f"line {lineno}: expected a JSON object, got {type(record).__name__}")
                continue
            completion = record.get("completion")
            if not isinstance(completion, str):
                what = "is missing" if completion is None else f"must be a string, got {type(completion).__name__}"
                problems.append(f"line {lineno}: the 'completion' field {what}")
                continue
            try:
                example = prepare(record, options=options, where=f"line {lineno}")
            except UnparseableAnswer as err:
                if skip_unparseable:
                    skipped += 1
                    continue
                problems.append(str(err))
                continue
            except UserError as err:
                problems.append(str(err))
                continue
            records.append(record)
            examples.append(example)
    except UnicodeDecodeError as err:
        raise UserError(f"--input {path!r} is not UTF-8 text: {err}") from None
    finally:
        if stream is not sys.stdin:
            stream.close()
    if problems:
        more = f" (showing the first {_MAX_PROBLEMS})" if len(problems) > _MAX_PROBLEMS else ""
        raise UserError(
            f"--input {path!r}: {len(problems)} malformed line(s){more}. Each line must be a JSON object with "
            f"the task's example fields and a 'completion' string:",
            problems=problems[:_MAX_PROBLEMS],
        )
    if not records and not skipped:
        raise UserError(f"--input {path!r} holds no records.")
    return records, examples, skipped


@task.command("score")
@click.argument("name")
@click.option(
    "--input",
    "input_path",
    required=True,
    metavar="FILE.jsonl",
    help="JSON lines: the task's example fields (gsm8k: question, answer) plus `completion`. '-' = stdin.",
)
@click.option("--output", "output_path", metavar="FILE.jsonl", help="Where the scored lines go (default: stdout).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="A task option, e.g. --set task.options.correct_mode=flexible (value parsed as YAML). Repeatable.",
)
def score(name: str, input_path: str, output_path: str | None, overrides: tuple[str, ...]) -> None:
    """Score saved completions with task NAME's reward functions.

    Each output line is the input line plus `rewards` (name -> value), `reward` (the
    weighted total) and `correct`; `reward_errors` appears when a reward function failed
    on that line. The mean of each reward goes to stderr.
    """
    from grpo.core.plugins import get_plugins
    from grpo.engine.rollout.scoring import TOTAL, score_completions

    plugin = get_plugins().get("task", name)
    options = _task_options(plugin, overrides)
    records, examples, skipped = _read(plugin, options, input_path)
    scores = score_completions(plugin, options, examples, [r["completion"] for r in records])

    lines = []
    for i, record in enumerate(records):
        out = dict(record)
        out["rewards"] = scores.rewards[i]
        out["reward"] = scores.totals[i]
        out["correct"] = scores.correct[i]
        if scores.failed[i]:
            out["reward_errors"] = list(scores.failed[i])
        lines.append(json.dumps(out, ensure_ascii=False))
    text = "".join(line + "\n" for line in lines)
    if output_path is None or output_path == "-":
        click.echo(text, nl=False)
    else:
        try:
            Path(output_path).write_text(text, encoding="utf-8")
        except OSError as err:
            raise UserError(f"--output {output_path!r} could not be written: {err}") from None

    means = scores.means()
    width = max(len(n) for n in (*scores.names, TOTAL, "accuracy"))
    skip_note = f", skipped {skipped} line(s) with an unreadable ground truth" if skipped else ""
    summary = [f"{name}: scored {len(records)} completion(s){skip_note}"]
    summary.append(f"  {'reward'.ljust(width)}  {'mean':>8}  {'weight':>7}  errors")
    for n in scores.names:
        summary.append(f"  {n.ljust(width)}  {means[n]:8.4f}  {scores.weights[n]:7.3g}  {scores.errors[n]}")
    summary.append(f"  {TOTAL.ljust(width)}  {means[TOTAL]:8.4f}")
    accuracy = sum(scores.correct) / len(records) if records else 0.0
    summary.append(f"  {'accuracy'.ljust(width)}  {accuracy:8.4f}")
    for n, msg in scores.first_errors.items():
        summary.append(f"  reward {n!r} failed on {scores.errors[n]} completion(s); first: {msg}")
    for n, count in scores.not_applicable.items():
        if count:
            summary.append(f"  reward {n!r} was not applicable (None or NaN, scored 0) to {count} completion(s)")
    click.echo("\n".join(summary), err=True)
