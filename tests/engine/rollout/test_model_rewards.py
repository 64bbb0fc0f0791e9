"""Reward models as batched scorers on the rollout devices, and model rewards joined to a
task's (issue 55: reward model parity through the scorer, template, normalisation)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from transformers import AutoTokenizer

from grpo.core.config import load_config
from grpo.core.config.rewards import RewardModelConfig
from grpo.core.errors import UserError
from grpo.engine.rollout.model_rewards import ModelRewards, RewardModelScorer, StepModelRewards, local_mesh
from tests._model_fixtures import mesh
from tests._reward_models import classifier_checkpoint

PROMPTS = ["3+4=", [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+30="}], "9+9=", "1+1=",
           "5+0="]
COMPLETIONS = ["7", "42", "eighteen or so", [{"role": "assistant", "content": "2"}], ""]


def _scorer(**options) -> RewardModelScorer:
    path, _ = classifier_checkpoint("Qwen2", 1)
    cfg = RewardModelConfig(kind="reward_model", name="rm", checkpoint=str(path), dtype="float32", **options)
    return RewardModelScorer(cfg, mesh=local_mesh(mesh(fsdp=2)), field="task.model_rewards[0]")


def _transformers_score(text: str, tokenizer, *, last: int | None = None) -> float:
    """transformers' score of one text alone (no padding at all): the reference."""
    import torch

    _, hf = classifier_checkpoint("Qwen2", 1)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[-last:] if last else ids
    with torch.no_grad():
        return float(hf(input_ids=torch.tensor([ids])).logits[0, 0])


def test_scores_equal_transformers_row_by_row():
    """Micro-batches of 3 rows (padded to 4, split over 2 devices; the last batch mostly
    padding) score each row as transformers scores it alone."""
    scorer = _scorer(template="Q: {prompt}\nA: {completion}", micro_batch=3)
    assert scorer.rows == 4
    got = scorer(COMPLETIONS, prompts=PROMPTS)
    tok = AutoTokenizer.from_pretrained(scorer.classifier.directory)
    texts = ["Q: 3+4=\nA: 7", "Q: Add.\n\n12+30=\nA: 42", "Q: 9+9=\nA: eighteen or so", "Q: 1+1=\nA: 2",
             "Q: 5+0=\nA: "]
    want = [_transformers_score(t, tok) for t in texts]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_chat_template_and_columns():
    scorer = _scorer()
    tok = scorer.tokenizer
    msgs = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    assert scorer.text("3+4=", "7", {}) == tok.apply_chat_template(msgs, tokenize=False)
    np.testing.assert_allclose(scorer(["7"], prompts=["3+4="]),
                               [_transformers_score(tok.apply_chat_template(msgs, tokenize=False), tok)], atol=1e-5)
    columned = _scorer(template="{completion} vs {answer}")
    assert columned.text("p", "7", {"answer": "8"}) == "7 vs 8"
    with pytest.raises(UserError, match=r"task.model_rewards\[0\].template: the template's field \{answer\}"):
        columned(["7"], prompts=["p"])


def test_normalisation_and_truncation():
    raw = np.asarray(_scorer(template="{prompt}{completion}")(COMPLETIONS[:3], prompts=PROMPTS[:3]))
    sig = _scorer(template="{prompt}{completion}", mean=0.5, std=2.0, normalize="sigmoid")
    np.testing.assert_allclose(sig(COMPLETIONS[:3], prompts=PROMPTS[:3]), 1 / (1 + np.exp(-(raw - 0.5) / 2.0)),
                               rtol=1e-5)
    tanh = _scorer(template="{prompt}{completion}", normalize="tanh")
    np.testing.assert_allclose(tanh(COMPLETIONS[:3], prompts=PROMPTS[:3]), np.tanh(raw), rtol=1e-5)
    short = _scorer(template="{prompt}{completion}", max_length=3)
    got = short(["eighteen or so"], prompts=["9+9="])
    assert short.truncated == 1
    np.testing.assert_allclose(got, [_transformers_score("9+9=eighteen or so", short.tokenizer, last=3)], atol=1e-5)


def test_a_label_the_head_lacks_is_named():
    with pytest.raises(UserError, match=r"task.model_rewards\[0\].label=1, but the score head .* has 1 output"):
        _scorer(label=1)


class _Fake:
    def __init__(self, name, values):
        self.name, self.values, self.calls = name, values, []

    def __call__(self, completions, prompts=None, **columns):
        self.calls.append((list(completions), list(prompts), dict(columns)))
        return self.values


def test_joined_to_the_task_rewards(monkeypatch):
    """Each model reward joins ``by_fn`` after the task's, weighted into the total; a
    None (a judge's parse failure) is 0 and flagged "not applicable"; the scorers get the
    rows' prompt messages and columns as lists (TRL's convention)."""
    config = load_config("configs/quickstart.yaml", ["task.model_rewards=" + str([
        {"kind": "judge", "name": "j", "template": "{completion}", "weight": 2.0},
        {"kind": "judge", "name": "k", "template": "{completion}", "weight": -1.0}]).replace("'", '"')])
    fakes = [_Fake("j", [1.0, None, 0.5]), _Fake("k", [3.0, 4.0, float("nan")])]
    monkeypatch.setattr(ModelRewards, "build", classmethod(
        lambda cls, config, **kw: cls(fakes, {"j": 2.0, "k": -1.0})))

    class Task:
        def prompt_messages(self, ex, *, options):
            return [{"role": "user", "content": ex["question"]}]

    programs = types.SimpleNamespace(rollout=types.SimpleNamespace(mesh=None), plugins=None)
    joined = StepModelRewards(config, programs=programs, task=Task(), task_options=None)
    examples = [{"question": f"q{i}", "answer": i} for i in range(3)]
    by_fn = {"correct": np.asarray([1.0, 0.0, 0.0], np.float32)}
    flags = np.zeros((3, 4, 1), np.int32)  # failed, not applicable, scored, timed out
    flags[:, 2] = 1
    totals, flags = joined.join(examples, ["a", "b", "c"], np.asarray([1.0, 0.0, 0.0], np.float32), by_fn, flags)
    assert list(by_fn) == ["correct", "j", "k"]
    np.testing.assert_allclose(totals, [1 + 2 - 3, 0 + 0 - 4, 0 + 1 - 0])
    np.testing.assert_array_equal(by_fn["j"], [1.0, 0.0, 0.5])
    np.testing.assert_array_equal(flags[:, 1], [[0, 0, 0], [0, 1, 0], [0, 0, 1]])  # not applicable
    np.testing.assert_array_equal(flags[:, 0], 0)
    np.testing.assert_array_equal(flags[:, 2], 1)
    np.testing.assert_array_equal(flags[:, 3], 0)
    completions, prompts, columns = fakes[0].calls[0]
    assert completions == ["a", "b", "c"] and prompts[1] == [{"role": "user", "content": "q1"}]
    assert columns == {"question": ["q0", "q1", "q2"], "answer": [0, 1, 2]}


def test_a_name_the_task_has_is_refused():
    config = load_config("configs/quickstart.yaml", [
        'task.model_rewards=[{"kind": "judge", "name": "correct", "template": "{completion}"}]'])
    with pytest.raises(UserError, match=r"task.model_rewards\[0\].name: 'correct' is already a reward of task"):
        ModelRewards.build(config, mesh=mesh(), plugins=None, taken=["correct", "prefix"])
