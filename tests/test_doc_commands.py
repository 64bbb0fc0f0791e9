"""Every ``grpo ...`` command that README.md, every page of the documentation site
(docs/**/*.md) and the configs' comments show works as written, for every subcommand.

The commands are found, not listed: a new page or section is checked as soon as it is
written. Each one is parsed by the CLI's own click command (an unknown flag fails), then:

- ``grpo config ...``, ``grpo plugins list``, ``grpo mesh preview``: run through the CLI
  itself (cheap: no model, no compile);
- ``grpo run``: its config loaded with the ``--set`` overrides the command's flags amount
  to (:func:`grpo.engine.cli.run_flags`), as ``grpo run`` loads it, and a LoRA config's
  targets checked against the architecture, as ``grpo config validate`` does;
- ``grpo plan``: its config loaded, then checked for the plan's TPU topology as that
  many processes x devices (:meth:`TpuTopology.hosts`) by ``resolve_layout``, the code
  ``grpo config validate --processes P --local-devices L`` runs. Nothing is compiled;
- ``grpo eval RUN_DIR --set ...``: the ``--set`` overrides applied to a run of
  ``configs/quickstart.yaml`` (``RUN_DIR`` stands for one), as ``grpo eval`` applies them
  to the run's saved config, so an override the config refuses fails here (issue 52:
  ``--set eval.k=8`` alone refuses ``eval.greedy=true``);
- ``grpo export``, ``grpo plot``, ``grpo bench ...``, ``grpo model inspect``,
  ``grpo task score``: parsed only (they need a run, a checkpoint or minutes of compiling).

Synopsis lines (``grpo run CONFIG [--set ...]``, ``--run-dir "$RUN_DIR"``) are not
commands, except that ``RUN_DIR`` as the run argument of ``eval``/``export``/``plot`` stands
for a quickstart run; a command in a config file's comment without a config means that file.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from grpo.core.cli import cli

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "configs").rglob("*.yaml"))]
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|\$|\.\.\.|^\[|^<")
_RUN_DIR_COMMANDS = ("eval", "export", "plot")  # whose first argument is a run directory
_RUN_DIR_STANDS_FOR = "configs/quickstart.yaml"  # the run RUN_DIR stands for in `grpo eval RUN_DIR --set ...`
_RUN_THROUGH_CLI = (("config",), ("plugins",), ("mesh",))  # cheap: validation, listing, arithmetic


def _subcommands() -> dict[str, tuple[str, ...]]:
    """``{top-level command: its subcommands}`` (``()`` for a plain command), from the CLI."""
    import click

    ctx = click.Context(cli)
    out = {}
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        out[name] = tuple(command.list_commands(click.Context(command))) if isinstance(command, click.Group) else ()
    return out


SUBCOMMANDS = _subcommands()
_START = re.compile(r"(?:^|(?<=[\s`'\"(;&|]))grpo\s+(?:" + "|".join(SUBCOMMANDS) + r")\b")


def _texts(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text that may hold a command, whether it is code rather than an
    inline span of prose): code-block lines (``\\`` continuations joined), inline code
    spans of prose, and the configs' comments."""
    lines = path.read_text().splitlines()
    out: list[tuple[int, str, bool]] = []
    fenced = False
    output = False  # a ```text block shows what a command prints (usage lines), not commands
    pending = ""
    for i, line in enumerate(lines, 1):
        if path.suffix == ".md" and line.lstrip().startswith("```"):
            fenced = not fenced
            output = fenced and line.strip() == "```text"
            continue
        if output:
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
            out.append((i, pending + line, True))
            pending = ""
        else:
            out.extend((i, span, False) for span in re.findall(r"`([^`]+)`", line))
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


def _params(argv: list[str], resilient: bool = True) -> dict:
    """The command's parameters as click parses them (an unknown flag is a UsageError),
    descending through groups (``grpo bench rollout ...``)."""
    import click

    ctx = cli.make_context("grpo", list(argv), resilient_parsing=True)
    command, args = cli, list(argv)
    while isinstance(command, click.Group):
        name, command, args = command.resolve_command(ctx, args)
        ctx = command.make_context(name, args, parent=ctx, resilient_parsing=resilient or isinstance(command, click.Group))
    return dict(ctx.params)


def find_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv after "grpo")`` of every runnable command the docs show."""
    found = []
    for path in SOURCES:
        for line, text, code in _texts(path):
            for match in _START.finditer(text):
                argv = _tokens(text[match.start():])[1:]
                if not argv:
                    continue
                if argv[0] not in SUBCOMMANDS:
                    continue  # "`grpo plan` compiles": the word ran into a quote
                subs = SUBCOMMANDS[argv[0]]
                if subs and (len(argv) < 2 or argv[1] not in subs):
                    continue  # "`grpo bench` times ...": a mention of the group
                group = argv[:2] if subs else argv[:1]
                rest = argv[len(group):]
                if _needs_argument(group) and not any(not a.startswith("-") for a in rest[:1]):
                    if path.suffix != ".yaml" or not rest:
                        continue  # a mention ("`grpo run` writes..."), not a command
                    rest = [str(path.relative_to(ROOT))] + rest  # "this config", in its own comment
                run_dir = group[0] in _RUN_DIR_COMMANDS and rest[:1] == ["RUN_DIR"]  # stands for a quickstart run
                if any(_PLACEHOLDER.search(a) for a in rest[1 if run_dir else 0:]):
                    continue  # a synopsis: CONFIG, [--set ...], $RUN_DIR
                if not code and _incomplete(group + rest):
                    continue  # "`grpo mesh preview` warns ...": prose naming a command, its options left out
                found.append((f"{path.relative_to(ROOT)}:{line}", group + rest))
    return found


def _incomplete(argv: list[str]) -> bool:
    """Whether click refuses ``argv`` for a missing required option or option value only."""
    import click

    try:
        _params(argv, resilient=False)
    except (click.MissingParameter, click.BadOptionUsage):
        return True
    except click.UsageError:
        return False
    return False


def _needs_argument(group: list[str]) -> bool:
    """Whether the command takes a required positional argument (a config, a run directory)."""
    import click

    command = cli.get_command(click.Context(cli), group[0])
    if len(group) > 1:
        command = command.get_command(click.Context(command), group[1])
    return any(isinstance(p, click.Argument) and p.required for p in command.params)


COMMANDS = find_commands()


def test_the_docs_commands_are_found():
    """The finder sees the commands it must (so a change to it cannot silently skip them),
    and the docs show every subcommand of the CLI at least once as a checked command."""
    argvs = [argv for _, argv in COMMANDS]
    assert ["run", "configs/quickstart.yaml"] in argvs
    assert ["plan", "configs/gsm8k_qwen25_3b_v6e8.yaml", "--topology", "v6e-8", "--set", "rollout.style=legacy"] in argvs
    assert ["config", "validate", "configs/gsm8k_qwen25_3b_v6e16.yaml", "--processes", "4", "--local-devices", "4"] in argvs
    assert ["plan", "configs/gsm8k_qwen3_1p7b_v6e8.yaml", "--topology", "v6e-8"] in argvs  # from a config's comment
    assert not [a for a in argvs if a[0] == "run" and a[1] == "RECIPE"]
    assert any(a[0] == "eval" and a[1] == "RUN_DIR" and "--set" in a for a in argvs)  # issue 52's eval.k=8 line
    assert any(str(w).startswith("docs/guides/") for w, _ in COMMANDS)  # pages in subfolders are read
    shown = {tuple(a[:2]) if SUBCOMMANDS[a[0]] else (a[0],) for a in argvs}
    every = {(name, sub) for name, subs in SUBCOMMANDS.items() for sub in subs} | {
        (name,) for name, subs in SUBCOMMANDS.items() if not subs}
    assert not every - shown, f"no page shows these commands in a checkable form: {sorted(every - shown)}"


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} grpo {' '.join(a)}" for w, a in COMMANDS])
def test_the_command_works_as_written(where, argv, monkeypatch):
    from grpo.core.config import load_config, resolve_layout
    from grpo.core.contracts import Topology

    monkeypatch.chdir(ROOT)
    if tuple(argv[:1]) in _RUN_THROUGH_CLI:
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
    if argv[0] == "eval" and argv[1] == "RUN_DIR":
        load_config(_RUN_DIR_STANDS_FOR, list(params["overrides"]))
        return
    if argv[0] != "plan":
        return  # parsed: export, plot, bench, model inspect, task score
    from grpo.engine.planning.tpu import parse_topology

    config = load_config(params["config_path"], list(params["overrides"]))
    processes, local = parse_topology(params["topology"]).hosts()
    resolve_layout(config, Topology(process_count=processes, local_device_count=local, platform="tpu"))


def test_an_eval_override_the_run_refuses_fails_here():
    """Issue 52: the README's ``grpo eval RUN_DIR --set eval.k=8`` failed as written
    (``eval.greedy=true needs eval.k=1``); this test's check of an eval line catches it."""
    from grpo.core.config import load_config

    with pytest.raises(Exception, match="eval.greedy=true needs eval.k=1"):
        load_config(_RUN_DIR_STANDS_FOR, ["eval.k=8"])
    load_config(_RUN_DIR_STANDS_FOR, ["eval.greedy=false", "eval.k=8"])


def _pip_installs(path: Path) -> list[tuple[int, str, str]]:
    """(line, the ``pip install ...`` command, the heading it sits under) in a page."""
    found, heading = [], ""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#") and path.suffix == ".md" and not line.startswith("#!"):
            heading = line
        for match in re.finditer(r"pip install [^`#\n']+", line):
            found.append((i, match.group(0).strip(), heading))
    return found


def test_every_install_line_works_from_a_clone():
    """Issue 52: the README told a newcomer to ``pip install grpo-jax``, which is not
    published. Every ``pip install`` that README.md, the site and the configs show installs
    this checkout (``-e .``, ``-e ".[extra]"``, a built wheel) or a published package other
    than grpo, and names only extras pyproject.toml defines; the published name appears
    only under a heading about publishing."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([a-z0-9_-]+) = \[", section, re.M))  # tomllib is Python 3.11+
    assert {"tpu", "cuda", "plan", "dev", "docs"} <= extras, extras
    seen = 0
    for path in [p for p in SOURCES if p.suffix == ".md"] + sorted((ROOT / "configs").rglob("*.yaml")):
        for line, command, heading in _pip_installs(path):
            seen += 1
            where = f"{path.relative_to(ROOT)}:{line}: {command}"
            if "grpo-jax" in command:
                assert "publish" in heading.lower(), f"{where}: grpo-jax is not published; install from a clone"
            for extra_list in re.findall(r"\.\[([a-z0-9_,-]+)\]", command):
                unknown = set(extra_list.split(",")) - extras
                assert not unknown, f"{where}: no such extra {sorted(unknown)} in pyproject.toml"
    assert seen >= 10


def test_the_readme_fits_on_two_screens():
    """Issue 52: the README is the landing page (at most 200 lines); the rest is the site."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
