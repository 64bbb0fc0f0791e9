"""The import graph of the ``grpo`` package, read from the source (AST, lazy imports
inside functions included): no cycles, nothing below the engine imports it, the built-in
plugins are leaves (nothing in core, the engine or the models imports them), and each
room of ``grpo.engine`` imports only what its ``__init__`` docstring allows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import grpo

ROOT = Path(grpo.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The grpo module an imported name lives in (``a.b.c`` -> ``a.b`` if c is an attribute)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Every grpo module ``module`` imports, at module level or lazily in a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for name in names:
            if name == "grpo" or name.startswith("grpo."):
                owner = _owner(name)
                if owner and owner != module:
                    found.add(owner)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_is_read():
    # The reader sees lazy imports inside functions and `from pkg import submodule`.
    assert "grpo.engine.evaluation" in GRAPH["grpo.engine.trainer"]
    assert "grpo.engine.runs.rundir" in GRAPH["grpo.engine.trainer"]  # from grpo.engine.runs import rundir
    assert "grpo.engine.rollout.scoring" in GRAPH["grpo.plugins.tasks.cli"]  # imported inside a command
    assert len(MODULES) > 60


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("below", ["grpo.models", "grpo.sharding", "grpo.core", "grpo.kernels"])
def test_nothing_below_the_engine_imports_it(below):
    # grpo.core.cli dispatches `grpo <command>` to the engine's commands: the one way up.
    offenders = {
        m: sorted(d for d in deps if _within(d, "grpo.engine"))
        for m, deps in GRAPH.items()
        if _within(m, below) and m != "grpo.core.cli"
    }
    assert {m: d for m, d in offenders.items() if d} == {}


@pytest.mark.parametrize("layer", ["grpo.core", "grpo.engine", "grpo.models", "grpo.sharding", "grpo.kernels"])
def test_plugins_are_leaves(layer):
    # Built-in plugins use the engine as third-party plugins would; nothing under them
    # imports a plugin module (grpo.core.plugins names the built-ins by string).
    offenders = {
        m: sorted(d for d in deps if _within(d, "grpo.plugins"))
        for m, deps in GRAPH.items()
        if _within(m, layer)
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def _rooms() -> dict[str, set[str]]:
    """Each ``grpo.engine`` room and the prefixes its docstring's ``May import:`` lists."""
    rooms = {}
    for init in sorted((ROOT / "engine").glob("*/__init__.py")):
        name = f"grpo.engine.{init.parent.name}"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import:" in doc, f"{name}'s docstring does not say what it may import"
        allowed = doc.split("May import:", 1)[1]
        rooms[name] = set(re.findall(r"``(grpo[\w.]*)``", allowed))
    return rooms


ROOMS = _rooms()


def test_engine_has_rooms_and_few_loose_modules():
    assert set(ROOMS) >= {
        "grpo.engine.parallel", "grpo.engine.rollout", "grpo.engine.training", "grpo.engine.runs",
        "grpo.engine.planning", "grpo.engine.bench", "grpo.engine.loop",
    }
    loose = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(loose) <= 8, loose
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse(MODULES[room].read_text(encoding="utf-8")))
        # The docstring names every module the room holds.
        for path in MODULES[room].parent.glob("*.py"):
            if path.name != "__init__.py":
                assert f"``{path.stem}``" in doc, f"{room}'s docstring does not mention {path.stem}"


# --------------------------------------------------------------------------- kernels and layers
# grpo.kernels (every Pallas kernel) sits below the models, and grpo.models.layers below
# the decoder: each imports only what its __init__ docstring's "May import:" lists.


@pytest.mark.parametrize("package", ["grpo.kernels", "grpo.models.layers"])
def test_kernels_and_layers_import_only_what_they_declare(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text(encoding="utf-8"))) or ""
    assert "May import:" in doc, f"{package}'s docstring does not say what it may import"
    allowed = set(re.findall(r"``(grpo[\w.]*)``", doc.split("May import:", 1)[1])) | {package}
    bad = {
        m: sorted(d for d in deps if not any(_within(d, a) for a in allowed))
        for m, deps in GRAPH.items()
        if _within(m, package)
    }
    assert {m: d for m, d in bad.items() if d} == {}, f"{package} may import only {sorted(allowed)}"


TESTS = Path(__file__).parent
# Tests of the whole package (grpo.api is its top module, grpo/__init__.py its public
# surface) or of the repository (configs/, configs/launch/) stay at the top.
TOP_LEVEL_TESTS = {
    "test_api.py", "test_api_surface.py", "test_architecture.py", "test_doc_commands.py", "test_docs_reference.py", "test_install.py", "test_launch_recipes.py",
    "test_public_api.py",
}
# End-to-end runs (whole `grpo run`s, several processes, a third-party package installed)
# sit in tests/integration/, which mirrors nothing; fixtures/ holds plugin packages.
UNMIRRORED = ("fixtures", "integration")


def test_tests_mirror_the_package():
    """A module's tests sit where a newcomer looks for them (tests/README.md): a test file
    below tests/ is in a folder that mirrors a package of grpo/ (tests/engine/rollout/ for
    grpo/engine/rollout/). No two test files share a name: pytest's default import mode
    imports them by name from folders without ``__init__.py``."""
    files = [f for f in TESTS.rglob("test_*.py") if "fixtures" not in f.relative_to(TESTS).parts]
    assert {f.name for f in files if f.parent == TESTS} == TOP_LEVEL_TESTS
    for f in files:
        folder = f.parent.relative_to(TESTS)
        if folder.parts and folder.parts[0] not in UNMIRRORED:
            assert (ROOT / folder / "__init__.py").is_file(), f"{f.relative_to(TESTS)}: no package grpo/{folder}"
    names = sorted(f.name for f in files)
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    assert not [p for p in TESTS.rglob("__init__.py") if "fixtures" not in p.relative_to(TESTS).parts]


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_rooms_import_only_what_they_declare(room):
    allowed = ROOMS[room] | {room}
    bad = {
        m: sorted(d for d in deps if not any(_within(d, a) for a in allowed))
        for m, deps in GRAPH.items()
        if _within(m, room)
    }
    assert {m: d for m, d in bad.items() if d} == {}, f"{room} may import only {sorted(allowed)}"


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_is_over_100_lines():
    long = {
        f"{module}.{fn.name}": fn.end_lineno - fn.lineno + 1
        for module, path in MODULES.items()
        for fn in _functions(path)
        if fn.end_lineno - fn.lineno + 1 > 100
    }
    assert long == {}


def test_no_module_is_over_700_lines():
    """A module holds one thing (issue 48: rooms that hold one thing each)."""
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700}
    assert long == {}


# The continuous engine's own room: only these modules import its core (scheduler, pages,
# runner, loop); every other caller speaks the engine contract (grpo.RolloutEngine).
ENGINE_ROOM = ("grpo.engine.rollout.paged", "grpo.engine.rollout.continuous", "grpo.engine.rollout.continuous_multiturn")
# What only an engine itself touches: its jitted programs and its private session state.
ENGINE_INTERNALS = {"start_jit", "prefill_jit", "decode_jit", "extend_jit", "read_jit", "prefill_rows", "_prefill",
                    "_place", "_core", "_session", "_new_core", "_submit", "_outputs"}


def test_only_the_engine_s_room_imports_its_core():
    users = {m for m, deps in GRAPH.items() if any(_within(d, "grpo.engine.rollout.paged") for d in deps)}
    assert users and all(any(_within(m, r) for r in ENGINE_ROOM) for m in users), sorted(users)


def _engine_internal_uses(path: Path) -> list[str]:
    """``x.name`` for ``name`` in :data:`ENGINE_INTERNALS` where ``x`` is not ``self``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def test_feeders_use_the_engine_contract_only():
    """Outside the engines' own modules nothing reaches into an engine: no feeder calls
    its programs or its private methods (the static and multi-turn samplers, the
    continuous engine and its core are the engines)."""
    # The rollout benchmark times the static engine's own prefill and decode programs apart.
    engines = ENGINE_ROOM + ("grpo.engine.rollout.sampler", "grpo.engine.rollout.multiturn", "grpo.engine.bench.rollout")
    bad = {m: uses for m, p in MODULES.items()
           if not any(_within(m, e) for e in engines) and (uses := _engine_internal_uses(p))}
    assert bad == {}


def _probes(path: Path) -> list[str]:
    """``hasattr(x, ...)`` on an engine (``x`` names a sampler or an engine) and
    ``isinstance(x, C)`` on a pipeline, a rollout source or a weight sync."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2:
            subject, kind = (ast.unparse(a) for a in node.args)
            if node.func.id == "hasattr" and any(w in subject.lower() for w in ("sampler", "engine")):
                out.append(ast.unparse(node))
            if node.func.id == "isinstance" and any(w in kind for w in ("Pipeline", "Source", "Sync")):
                out.append(ast.unparse(node))
    return out


def test_no_probe_on_an_engine_and_no_isinstance_on_a_pipeline():
    """A caller asks an engine through its contract (``streams``, ``simulates``,
    ``jitted``), and the loop composes a rollout source with a weight sync: no
    ``hasattr`` on an engine, no ``isinstance`` on a pipeline anywhere in grpo/."""
    bad = {m: found for m, p in MODULES.items() if (found := _probes(p))}
    assert bad == {}


def test_probe_reader_finds_probes(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("hasattr(self.sampler, 'stream')\nisinstance(p, ProcessPipeline)\nhasattr(x, 'y')\n"
                 "engine._prefill(1)\nself._prefill(2)\n")
    assert _probes(f) == ["hasattr(self.sampler, 'stream')", "isinstance(p, ProcessPipeline)"]
    assert _engine_internal_uses(f) == ["engine._prefill (line 4)"]


def _type_tests(path: Path) -> list[str]:
    """Where a module calls ``isinstance`` or ``hasattr``."""
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"isinstance", "hasattr"}]


@pytest.mark.parametrize("module", ["grpo.engine.trainer", "grpo.engine.loop.loop", "grpo.engine.loop.factory",
                                    "grpo.engine.loop.sources", "grpo.engine.loop.sync"])
def test_the_loop_does_not_branch_on_its_mode(module):
    # A mode is a source x a weight sync chosen in grpo.engine.loop.factory by config:
    # nothing asks which pipeline, source or engine it holds.
    assert _type_tests(MODULES[module]) == []


def _jit_calls(path: Path) -> list[str]:
    """Where a module builds a jitted program: ``jax.jit(...)``, ``jit(...)``,
    ``nnx.jit(...)``, ``@jax.jit`` or ``partial(jax.jit, ...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in {"jit", "pmap"}:
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Name) and node.id in {"jit", "pmap"}:
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in {"jit", "pmap"} for a in node.names):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_jit_reader_finds_jits(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import jax\nf = jax.jit(lambda x: x)\nfrom jax import jit\n@jit\ndef g(x):\n    return x\n")
    assert len(_jit_calls(probe)) == 3  # jax.jit, the import of jit, @jit


@pytest.mark.parametrize("module", ["grpo.engine.trainer", "grpo.engine.evaluation", "grpo.engine.rollout.step",
                                    "grpo.engine.loop.loop"])
def test_the_loop_jits_nothing(module):
    # Every program a run executes comes from the program builder (grpo.engine.programs),
    # which `grpo plan` compiles and lists: the loop only calls them.
    assert _jit_calls(MODULES[module]) == []


@pytest.mark.slow
def test_the_plan_lists_every_program_a_run_executes(tmp_path, monkeypatch):
    """One step and one evaluation of a run with every feature that adds a program
    (multi-turn tools, dynamic sampling and down-sampling, turn credit, a reference model,
    LoRA dropout with merged sampling, evaluation): the programs the run executed are
    exactly the programs ``grpo plan`` lowers for the same config, by name. (Every
    token ends a turn and each environment replies once, so a random model's rows take
    two turns with an append between.)"""
    from grpo.core.config import load_config
    from grpo.core.contracts import EnvStep
    from grpo.engine.planning.plan import Planner
    from grpo.engine.rollout.conversations import Conversations
    from grpo.engine.rollout.tools import ToolEnvironment
    from grpo.engine.trainer import Trainer

    def reply_once(self, text):
        if getattr(self, "replied", False):
            return EnvStep(None, True, {})
        self.replied = True
        return EnvStep([{"role": "tool", "content": "7"}], False, {})

    monkeypatch.setattr(ToolEnvironment, "step", reply_once)
    monkeypatch.setattr(Conversations, "turn_stop_ids", lambda self: tuple(range(256)))

    overrides = [
        "train.steps=1", "train.prompts_per_step=4", "rollout.num_generations=4", "train.down_sampling.keep=2",
        "train.dynamic_sampling={enabled: true, max_rounds: 2}", "train.advantage.credit=turn", "loss.beta=0.04",
        "loss.mismatch.level=token", "model.lora={rank: 4, dropout: 0.1, sampler: merged}",
        "eval={every_n_steps: 1, num_examples: 4, batch_size: 4}", "checkpoint.at_end=false", "logging.plot=false",
    ]
    config = load_config(str(ROOT.parent / "configs" / "quickstart_tools.yaml"), overrides)
    trainer = Trainer(config, tmp_path)
    trainer.run()
    ran = {name for name, fns in trainer.programs.jitted().items() if any(f._cache_size() for f in fns)}

    planner = Planner("v6e-8")
    listed = planner.programs_to_compile(planner.subject(config))
    assert ran == {name for name, *_ in listed}
    assert {"start", "append", "gather_rows", "turn_advantages", "merge", "policy_logprobs", "eval_append"} <= ran
    for name, lower, *_ in listed:  # each lowers for the TPU topology (the plan tests compile them)
        assert lower() is not None, name
