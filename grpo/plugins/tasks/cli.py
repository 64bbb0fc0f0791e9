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


def _read(plugin: Any, options: Any, path: str, solutions: bool = False) -> tuple[list[dict], list[dict], int]:
    """(records, examples, skipped) from a jsonl file; UserError listing malformed lines.
    ``solutions``: each line's completion is its labelled solution (the task's
    ``reference_completion``), not a ``completion`` field."""
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
            completion = "" if solutions else record.get("completion")
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
            if solutions:
                record = {**record, "completion": plugin.reference_completion(example, options=options)}
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
@click.option("--solutions", is_flag=True,
              help="Score each line's labelled solution (a data file of the task) instead of a `completion` field.")
def score(name: str, input_path: str, output_path: str | None, overrides: tuple[str, ...], solutions: bool) -> None:
    """Score saved completions with task NAME's reward functions.

    Each output line is the input line plus `rewards` (name -> value), `reward` (the
    weighted total) and `correct`; `reward_errors` appears when a reward function failed
    on that line. With --solutions each line's labelled solution is scored instead (a
    data file of the task: gsm8k's `answer`, math's `solution`). A task with several
    answer checks (gsm8k, math: strict and math-verify) adds `checks` to each line and
    reports on stderr where they disagree. The mean of each reward goes to stderr.
    """
    from grpo.core.plugins import get_plugins
    from grpo.engine.rollout.scoring import TOTAL, score_completions

    plugin = get_plugins().get("task", name)
    options = _task_options(plugin, overrides)
    if solutions and not hasattr(plugin, "reference_completion"):
        raise UserError(f"--solutions: task {name!r} has no labelled solutions to score; give completions instead.")
    records, examples, skipped = _read(plugin, options, input_path, solutions)
    scores = score_completions(plugin, options, examples, [r["completion"] for r in records])
    checks = _checks(plugin, options, records, examples)

    lines = []
    for i, record in enumerate(records):
        out = dict(record)
        out["rewards"] = scores.rewards[i]
        out["reward"] = scores.totals[i]
        out["correct"] = scores.correct[i]
        if scores.failed[i]:
            out["reward_errors"] = list(scores.failed[i])
        if checks:
            out["checks"] = checks[i]
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
    summary += _agreement(checks)
    click.echo("\n".join(summary), err=True)


def _checks(plugin: Any, options: Any, records: list[dict], examples: list[dict]) -> list[dict[str, bool]]:
    """Each completion's verdict by each of the task's answer checks (``answer_checks``),
    when it has more than one; else nothing."""
    method = getattr(plugin, "answer_checks", None)
    if method is None:
        return []
    out = [method(r["completion"], ex, options=options) for r, ex in zip(records, examples)]
    return out if out and len(out[0]) > 1 else []


def _agreement(checks: list[dict[str, bool]]) -> list[str]:
    """The answer checks' agreement, and the first completions where they differ."""
    if not checks:
        return []
    names = list(checks[0])
    differ = [i for i, c in enumerate(checks) if len(set(c.values())) > 1]
    lines = [f"  answer checks {' and '.join(names)} agree on {len(checks) - len(differ)} of {len(checks)} "
             f"completion(s); correct by each: " + ", ".join(f"{n} {sum(c[n] for c in checks)}" for n in names)]
    for i in differ[:_MAX_PROBLEMS]:
        lines.append(f"    line {i + 1}: " + ", ".join(f"{n}={'correct' if checks[i][n] else 'wrong'}" for n in names))
    if len(differ) > _MAX_PROBLEMS:
        lines.append(f"    ... and {len(differ) - _MAX_PROBLEMS} more")
    return lines
