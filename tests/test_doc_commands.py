"""Every ``grpo run|plan|config ...`` command that README.md, docs/*.md and the configs'
comments show works as written.

The commands are found, not listed: a new README section is checked as soon as it is
written. Each one is parsed by the CLI's own click command (an unknown flag fails), then:

- ``grpo config ...``: run through the CLI itself (cheap: validation only);
- ``grpo run``: its config loaded with the ``--set`` overrides the command's flags amount
  to (:func:`grpo.engine.cli.run_flags`), as ``grpo run`` loads it, and a LoRA config's
  targets checked against the architecture, as ``grpo config validate`` does;
- ``grpo plan``: its config loaded, then checked for the plan's TPU topology as that
  many processes x devices (:meth:`TpuTopology.hosts`) by ``resolve_layout``, the code
  ``grpo config validate --processes P --local-devices L`` runs. Nothing is compiled.

Synopsis lines (``grpo run CONFIG [--set ...]``, ``--run-dir "$RUN_DIR"``) are not
commands; a command in a config file's comment without a config means that file.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from grpo.core.cli import cli

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").rglob("*.yaml"))]
_START = re.compile(r"(?:^|(?<=[\s`'\"(;&|]))grpo\s+(?:run|plan|config)\b")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|\$|\.\.\.|^\[|^<")


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line number, text that may hold a command): code-block lines (``\\``
    continuations joined), inline code spans of prose, and the configs' comments."""
    lines = path.read_text().splitlines()
    out: list[tuple[int, str]] = []
    fenced = False
    pending = ""
    for i, line in enumerate(lines, 1):
        if path.suffix == ".md" and line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if path.suffix == ".yaml":
            hash_ = line.find("#")
            if hash_ < 0:
                continue
            line = line[hash_ + 1:]
            fenced = "`" not in line
        if fenced:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((i, pending + line))
            pending = ""
        else:
            out.extend((i, span) for span in re.findall(r"`([^`]+)`", line))
    return out


def _tokens(text: str) -> list[str]:
    """The command's words up to the end of the shell command (``&&``, ``;``, ``|``, a
    comment); a quote left open (a command inside ``--command '...'``) ends it."""
    for attempt in (text, text.rstrip().rstrip("'\"")):
        lexer = shlex.shlex(attempt, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:
            continue
        for j, word in enumerate(words):
            if word and set(word) <= set(";&|"):
                return words[:j]
        return words
    return []


def find_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv after "grpo")`` of every runnable command the docs show."""
    found = []
    for path in SOURCES:
        for line, text in _texts(path):
            for match in _START.finditer(text):
                argv = _tokens(text[match.start():])[1:]
                if not argv:
                    continue
                group = argv[:2] if argv[0] == "config" else argv[:1]
                rest = argv[len(group):]
                if group != ["config", "schema"] and not any(not a.startswith("-") for a in rest[:1]):
                    if path.suffix != ".yaml" or not rest:
                        continue  # a mention ("`grpo run` writes..."), not a command
                    rest = [str(path.relative_to(ROOT))] + rest  # "this config", in its own comment
                if any(_PLACEHOLDER.search(a) for a in rest):
                    continue  # a synopsis: CONFIG, [--set ...], $RUN_DIR
                found.append((f"{path.relative_to(ROOT)}:{line}", group + rest))
    return found


COMMANDS = find_commands()


def test_the_docs_commands_are_found():
    """The finder sees the commands it must (so a change to it cannot silently skip them)."""
    argvs = [argv for _, argv in COMMANDS]
    assert ["run", "configs/quickstart.yaml"] in argvs
    assert ["plan", "configs/gsm8k_qwen25_3b_v6e8.yaml", "--topology", "v6e-8", "--set", "rollout.style=legacy"] in argvs
    assert ["config", "validate", "configs/gsm8k_qwen25_3b_v6e16.yaml", "--processes", "4", "--local-devices", "4"] in argvs
    assert ["plan", "configs/gsm8k_qwen3_1p7b_v6e8.yaml", "--topology", "v6e-8"] in argvs  # from a config's comment
    assert not [a for a in argvs if a[0] == "run" and a[1] == "RECIPE"]
    assert len(COMMANDS) >= 10


def _params(argv: list[str]) -> dict:
    """The command's parameters as click parses them (an unknown flag is a UsageError)."""
    ctx = cli.make_context("grpo", list(argv), resilient_parsing=True)
    name, command, rest = cli.resolve_command(ctx, list(argv))
    with command.make_context(name, rest, parent=ctx) as sub:
        return dict(sub.params)


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} grpo {' '.join(a)}" for w, a in COMMANDS])
def test_the_command_works_as_written(where, argv, monkeypatch):
    from grpo.core.config import load_config, resolve_layout
    from grpo.core.contracts import Topology

    monkeypatch.chdir(ROOT)
    if argv[0] == "config":
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 0, f"{where}: grpo {' '.join(argv)}\n{result.output}"
        return
    params = _params(argv)
    if argv[0] == "run":
        from grpo.core.cli import _check_lora
        from grpo.engine.cli import run_flags

        config = load_config(params["config_path"], run_flags(
            params["overrides"], params["coordinator_address"], params["num_processes"], params["process_id"]))
        if config.model.lora is not None:
            _check_lora(config)
        return
    from grpo.engine.planning.tpu import parse_topology

    config = load_config(params["config_path"], list(params["overrides"]))
    processes, local = parse_topology(params["topology"]).hosts()
    resolve_layout(config, Topology(process_count=processes, local_device_count=local, platform="tpu"))
