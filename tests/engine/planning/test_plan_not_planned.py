"""`grpo plan` of a rollout engine that lacks the contract's planning methods: the
rollout is left out and reported "not planned", the update side is still planned, and
nothing raises (grpo.RolloutEngine's planning defaults raise NotPlanned)."""

from __future__ import annotations

import json
import types

import pytest
import yaml
from click.testing import CliRunner

import grpo
from grpo.core.cli import cli


class SampleOnly(grpo.RolloutEngine):
    """A third-party engine as small as the contract allows: ``sample`` alone (here the
    built-in static sampler's, standing in for a client of an external server)."""

    def __init__(self, inner):
        self.inner, self.sampling = inner, inner.sampling

    def sample(self, params, prompt_tokens, prompt_mask, rng, examples):
        return self.inner.sample(params, prompt_tokens, prompt_mask, rng, examples)


class SampleOnlyPlugin(grpo.RolloutEnginePlugin):
    name = "sample_only"
    description = "An engine with sample() alone (tests)."
    Options = grpo.NoOptions

    def build(self, context, options):
        from grpo.engine.rollout.sampler import Sampler

        return SampleOnly(Sampler(context.graphdef, sampling=context.sampling, detokenize=context.detokenize,
                                  **context.sampler_kwargs))


@pytest.fixture
def sample_only_engine(monkeypatch):
    """``rollout.engine: sample_only`` registered for this test (a throwaway plugin module)."""
    from grpo.core import plugins

    @grpo.hookimpl
    def register_rollout_engines(register):
        register(SampleOnlyPlugin())

    module = types.ModuleType("sample_only_engine")
    module.register_rollout_engines = register_rollout_engines
    loaded = plugins.load_plugins(entry_points=False, extra_modules=[module])
    monkeypatch.setattr(plugins, "get_plugins", lambda: loaded)
    return loaded


def test_the_contract_s_planning_defaults_raise_not_planned():
    """Every planning method the plan calls defaults to NotPlanned (``jitted``: none);
    the built-in samplers implement them."""
    from grpo.engine.rollout.multiturn import MultiTurnSampler
    from grpo.engine.rollout.sampler import BaseSampler

    engine = SampleOnly(types.SimpleNamespace(sampling=None))
    for call in (engine.plan, engine.width, lambda: engine.allocated(8), lambda: engine.cache_slots(8),
                 lambda: engine.cache_bytes(None, rows=2, prompt_length=8),
                 lambda: engine.lowerings(None, prompts=1, prompt_length=8, key=None),
                 lambda: engine.abstract_output(prompts=1, prompt_length=8),
                 lambda: engine.simulate(prompt_lengths=[], completions=[], prompt_length=8)):
        with pytest.raises(grpo.NotPlanned, match="SampleOnly"):
            call()
    assert engine.jitted() == {} and engine.max_turns == 1 and not engine.simulates
    assert BaseSampler.plan is not grpo.RolloutEngine.plan
    assert MultiTurnSampler.width is not grpo.RolloutEngine.width
    assert MultiTurnSampler.allocated is not grpo.RolloutEngine.allocated


def test_an_engine_written_before_the_contract_keeps_its_planning_methods():
    """as_engine's wrapper forwards the planning methods the wrapped object has (the
    contract's defaults would shadow them) and the contract's defaults for the rest."""
    from grpo.core.contracts import as_engine

    class Old:
        sampling, max_turns = None, 3

        def sample(self, *args):
            return None

        def plan(self):
            return ((0, 4),)

    with pytest.warns(DeprecationWarning):
        engine = as_engine(Old(), name="old")
    assert engine.plan() == ((0, 4),) and engine.max_turns == 3
    with pytest.raises(grpo.NotPlanned):
        engine.width()


@pytest.mark.slow
def test_plan_of_an_engine_without_planning_methods_plans_the_update(sample_only_engine, tmp_path):
    """``rollout.engine: sample_only`` with dynamic sampling, a reference model and
    evaluation: `grpo plan` exits 0; the rollout's programs, evaluation's and gather_rows
    (which takes the engine's abstract output) are left out and ``not_planned`` says why;
    the reference pass, the update and the step's other glue are planned; the text says
    the engine is not planned."""
    pytest.importorskip("libtpu")
    from grpo.engine.planning.report import format_report

    config = {
        "model": {"source": "random", "random": {"preset": "tiny"}, "param_dtype": "bfloat16",
                  "compute_dtype": "bfloat16", "remat": "full"},
        "task": {"name": "arithmetic"},
        "rollout": {"engine": "sample_only", "num_generations": 4, "max_prompt_length": 16, "max_new_tokens": 16},
        "train": {"prompts_per_step": 8, "micro_batch_size": 8, "packing": {"enabled": False},
                  "dynamic_sampling": {"enabled": True, "max_rounds": 2}},
        "loss": {"impl": "jax", "beta": 0.04},
        "eval": {"every_n_steps": 1, "num_examples": 4, "batch_size": 4},
    }
    path = tmp_path / "sample_only.yaml"
    path.write_text(yaml.safe_dump(config))
    res = CliRunner().invoke(cli, ["plan", str(path), "--topology", "v6e:2x2", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["not_planned"]["rollout_engine"] == "sample_only"
    assert rep["not_planned"]["why"] == "SampleOnly has no cache model"
    assert set(rep["programs"]) == {"row_sums", "to_train", "reference", "update"}
    assert rep["fits"] is True and rep["compiler_error"] is None
    assert rep["peak_bytes_per_device"] == max(p["peak_bytes"] for p in rep["programs"].values())
    assert rep["state_bytes_per_device"]["kv_cache"] is None
    assert rep["eval"] is None and rep["roofline_eval_s"] is None
    assert rep["step_rollout"]["costed_as"] == "not planned"
    assert rep["roofline_step_s"] == pytest.approx(sum(p["roofline_s"] for p in rep["programs"].values()))
    text = format_report(rep)  # what `grpo plan` prints without --json
    assert "rollout engine sample_only: not planned (SampleOnly has no cache model)" in text
