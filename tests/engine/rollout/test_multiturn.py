"""The multi-turn rollout engine on a tiny Qwen2 over 8 CPU devices, with a scripted
environment: the update batch is the chat template's rendering of the whole conversation,
the loss mask is 1 exactly on the model's tokens, and the sampler's log-probs through the
KV-cache turns and appends equal a fresh forward over the whole sequence."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo.core.contracts import Environment, EnvStep, MeshLayout
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.rollout.multiturn import MultiTurnSampler, append_bucket
from grpo.engine.rollout.sampler import SamplingParams
from grpo.models.loading import load_hf
from grpo.models.decoder import positions_from_mask
from grpo.models.tiny import special_token_ids, write_tiny_checkpoint
from _glossary import assert_glossary
from _multiturn import opening_prompts

P, K, N, TURNS = 2, 4, 40, 3
TEMP = 0.8


class Scripted(Environment):
    """Answers every turn with a fixed tool message; the episode ends after two replies."""

    def __init__(self, row: int):
        self.row = row
        self.seen: list[str] = []

    def reset(self, example):
        return [{"role": "user", "content": example["q"]}]

    def step(self, model_turn_text):
        self.seen.append(model_turn_text)
        if len(self.seen) > 2:
            return EnvStep(None, True, {})
        return EnvStep([{"role": "tool", "content": f"r{self.row}.{len(self.seen)}"}], False, {"tool_calls": 1})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mt"), seed=3)
    mesh = build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))
    graphdef, params = nnx.split(load_hf(directory, mesh))
    return graphdef, params, mesh, AutoTokenizer.from_pretrained(directory)


def render(tokenizer):
    def fn(messages, tools, add_generation_prompt):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    return fn


def test_append_bucket():
    assert [append_bucket(n) for n in (0, 1, 8, 9, 16, 17, 22, 33, 100, 129)] == [8, 8, 8, 16, 16, 24, 24, 40, 112, 160]
    widths = [append_bucket(n) for n in range(1, 1025)]
    assert widths == sorted(widths) and all(n <= w <= 1.25 * n + 8 for n, w in zip(range(1, 1025), widths))


def scripted_rollout(setup, **sampler_kwargs):
    """A rollout of P prompts x K rows through :class:`Scripted` environments; turns end at
    any lowercase letter, so a random model takes several turns."""
    graphdef, params, mesh, tok = setup
    eos = special_token_ids()["<|im_end|>"]
    letters = sorted({i for c in "abcdefghijklmnopqrstuvwxyz" for i in tok(c, add_special_tokens=False)["input_ids"]})
    sampling = SamplingParams(max_new_tokens=N, num_generations=K, temperature=TEMP, eos_ids=(eos,),
                              pad_id=tok.pad_token_id, early_stop_chunk=4)
    mt = MultiTurnSampler(graphdef, mesh=mesh, batch_axes=("fsdp",), sampling=sampling, max_turns=TURNS,
                          turn_stop_ids=letters, **sampler_kwargs)
    examples = [{"q": "What is 2+3?"}, {"q": "Say hi"}]
    envs = [Scripted(r) for r in range(P * K)]
    openings = [envs[r].reset(examples[r // K]) for r in range(P * K)]
    rend = render(tok)
    ptok, pmask, Lp = opening_prompts(tok, rend, openings, prompts=P, generations=K)
    out, ep = mt.converse(params, ptok, pmask, jax.random.key(0), envs=envs, openings=openings, render=rend,
                          tokenizer=tok)
    return out, ep, rend, openings, Lp, set(letters) | {eos}


def test_scripted_transcript_mask_and_logprobs(setup):
    graphdef, params, mesh, tok = setup
    out, ep, rend, openings, Lp, _ = scripted_rollout(setup)
    tokens, mask, loss_mask = (np.asarray(x) for x in (out.tokens, out.mask, out.loss_mask))
    logprobs = np.asarray(out.logprobs)
    assert ep.num_turns.max() >= 2 and ep.tool_calls.sum() > 0 and (mask - loss_mask).sum() > 0

    for r in range(P * K):
        n = int(mask[r].sum())
        real, trained = tokens[r, :n].tolist(), loss_mask[r, :n]
        # Runs of model tokens and of inserted tokens alternate, one run per turn / reply.
        edges = np.flatnonzero(np.diff(trained)) + 1
        runs = np.split(np.arange(n), edges)
        assert [bool(trained[x[0]]) for x in runs] == [t["trained"] for t in ep.turns[r]][: len(runs)]
        assert sum(bool(trained[x[0]]) for x in runs) == ep.num_turns[r]
        assert np.all(logprobs[r][loss_mask[r] == 0] == 0) and np.all(loss_mask[r] <= mask[r])
        # The conversation through the template, the last model turn as sampled (stop token
        # included); rows whose turns re-tokenize to what was sampled compare token ids.
        convo = ep.messages[r]
        assert convo[-1]["role"] == "assistant"
        last = [real[i] for i in runs[-1]]
        whole = rend(convo[:-1], {}, True) + tok.decode(last, skip_special_tokens=False)
        prompt = tok(rend(openings[r], {}, True), add_special_tokens=False)["input_ids"]
        assert tok.decode(prompt + real, skip_special_tokens=False) == whole
        model_runs = [[real[i] for i in x] for x in runs if trained[x[0]]]
        if all(tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids for ids in model_runs):
            assert tok(whole, add_special_tokens=False)["input_ids"] == prompt + real

    # A fresh forward over prompt + completion gives the sampler's log-probs on model tokens.
    model = nnx.merge(graphdef, params)
    full = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    kv = jnp.concatenate([out.prompt_mask, out.mask], axis=1).astype(bool)
    hidden, _ = model(full, positions_from_mask(kv), kv)
    logits = model.logits(hidden[:, Lp - 1 : -1]) / TEMP
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), out.tokens[..., None], -1)[..., 0]
    ref = np.where(loss_mask == 1, np.asarray(ref), 0.0)
    np.testing.assert_allclose(logprobs, ref, atol=1e-5)


def test_max_turn_tokens_caps_every_turn_and_ends_a_capped_row(setup):
    """``max_turn_tokens`` bounds each model turn; a turn that reaches it without a stop
    token gets no reply and its row ends as truncated."""
    cap = 3
    out, ep, _, _, _, stops = scripted_rollout(setup, max_turn_tokens=cap)
    tokens, mask, loss_mask = (np.asarray(x) for x in (out.tokens, out.mask, out.loss_mask))
    truncated = np.asarray(out.truncated)
    capped = 0
    for r in range(P * K):
        n = int(mask[r].sum())
        trained = loss_mask[r, :n]
        runs = np.split(np.arange(n), np.flatnonzero(np.diff(trained)) + 1)
        model_runs = [tokens[r, x].tolist() for x in runs if trained[x[0]]]
        assert model_runs and all(len(run) <= cap for run in model_runs)
        for run in model_runs[:-1]:  # every turn that got a reply ended on a stop token
            assert run[-1] in stops
        last = model_runs[-1]
        if len(last) == cap and last[-1] not in stops:
            capped += 1
            assert truncated[r] and bool(trained[-1]), r  # no reply after the capped turn
    assert capped > 0 and ep.num_turns.max() >= 2


# --------------------------------------------------------------------------- a trainer run with bad tools


def flaky(mode: str) -> str:
    """A tool that misbehaves as asked.

    Args:
        mode: raise, hang, flood or object.
    """
    if mode == "raise":
        raise ValueError("asked to")
    if mode == "hang":
        time.sleep(2.0)
    if mode == "flood":
        return "7" * 100_000
    return {"mode": [mode, 1]}  # not a string, whatever the annotation says


MODES = ("raise", "hang", "flood", "object")


TOOLS_RUN = {
    "model": {"source": "random", "random": {"preset": "tiny", "tool_tokens": True}},
    "rollout": {"num_generations": 2, "max_prompt_length": 320, "prompt_buckets": [320],
                "max_new_tokens": 320, "max_turns": 2,
                "tool_timeout_s": 0.3, "early_stop_chunk": 8},
    "task": {"name": "arithmetic", "options": {"max_operand": 9, "num_examples": 64, "num_test_examples": 8,
                                               "chat_template": True,
                                               "reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}}},
    "train": {"steps": 1, "prompts_per_step": 8, "optimizer": {"learning_rate": 1e-3}},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": True},
}


def script_calls(monkeypatch, modes):
    """The arithmetic task with tools: whatever the model writes first, its environment
    "calls" ``flaky`` once per mode, then the episode ends after the model's next turn. A
    random model's turn ends at its first byte-level token (it never writes a stop)."""
    from grpo.core.contracts import ToolCall
    from grpo.engine.rollout.conversations import Conversations
    from grpo.plugins.tasks import ArithmeticTask
    from grpo.engine.rollout.tools import ToolEnvironment

    class Calls(ToolEnvironment):
        def step(self, model_turn_text):
            if getattr(self, "stepped", False):
                return EnvStep(None, True, {})
            self.stepped = True
            return super().step("".join(self.format.render_call(ToolCall("flaky", {"mode": m})) for m in modes))

    def environment(self, example, *, options, tool_format, timeout_s=10.0):
        return Calls(tools={"flaky": flaky}, format=tool_format, opening=self.prompt_messages(example, options=options),
                     timeout_s=timeout_s)

    monkeypatch.setattr(ArithmeticTask, "environment", environment)
    monkeypatch.setattr(Conversations, "turn_stop_ids", lambda self: tuple(range(256)))


def _assert_packed_as_rows(plan, ub, packed) -> None:
    """The packed batch (``train.packing`` is on by default) carries the rows' loss mask
    and per-token advantages at the slots that predict them: slot ``(b, t)`` of row ``r``
    holding its real token ``i`` predicts completion column ``i + 1 - prompt length`` when
    the next slot is the same segment (worked out here from the plan, not by the packer's
    own placement), and is 0 everywhere else (prompts, bin padding, sequence ends)."""
    # The scheduled layout [micro-batches, bins, L] read as bins [*, L].
    flat = lambda x: np.asarray(x).reshape(-1, np.shape(x)[-1])  # noqa: E731
    seg, row, index = flat(plan.segment_ids), flat(plan.row), flat(plan.index)
    assert seg.max() > 1  # really packed: a bin holds two conversations
    same_next = np.zeros(seg.shape, bool)
    same_next[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    col = index + 1 - np.asarray(ub.prompt_mask).sum(1)[row]
    b, t = np.nonzero(same_next & (col >= 0))
    want_mask, want_adv = np.zeros(seg.shape), np.zeros(seg.shape)
    want_mask[b, t] = np.asarray(ub.loss_mask)[row[b, t], col[b, t]]
    want_adv[b, t] = np.asarray(ub.advantages)[row[b, t], col[b, t]]
    assert 0 < want_mask.sum() < len(b)  # environment tokens inside the completions, not trained
    np.testing.assert_array_equal(flat(packed.mask), want_mask)
    np.testing.assert_array_equal(flat(packed.advantages), want_adv)


@pytest.mark.slow
def test_turn_credit_in_a_trainer_step(tmp_path, monkeypatch):
    """``train.advantage.credit: turn`` in a real step: the update gets advantages [B, N]
    that are, token by token, the sum of each scope's own group advantage of the step's
    rewards (recomputed here with NumPy from the scored rewards, the weights, the task's
    reward_turns and the config's override) over the model turns of the scope, 0 on
    inserted tokens; and the turn scopes of an unknown reward are a config error. On a
    tiny mixture-of-experts model with router replay (issue 54, multi-turn): every token
    the sampler fed, in a turn or an append (the environment's tokens too), carries its
    experts at its column, and the trainer's replayed routing agrees on every one."""
    from grpo.core.config import load_config
    from grpo.core.errors import ConfigError
    from grpo.engine.trainer import Trainer
    from grpo.plugins.tasks import ArithmeticTask

    script_calls(monkeypatch, ("raise",))

    def first_turn(completion, example):  # the random model's first turn: one byte-level token
        return ord([m for m in example["messages"] if m["role"] == "assistant"][0]["content"][:1] or " ") % 5 / 4

    rewards = {"a": lambda c, ex: float(len(c) % 3), "f": first_turn, "l": lambda c, ex: ord(c[-1:] or " ") % 7 / 6}
    weights = {"a": 1.0, "f": 0.5, "l": 0.25}
    monkeypatch.setattr(ArithmeticTask, "reward_functions", lambda self, *, options: rewards)
    monkeypatch.setattr(ArithmeticTask, "reward_weights", lambda self, *, options: weights)
    monkeypatch.setattr(ArithmeticTask, "reward_turns", lambda self, *, options: {"f": "first", "l": "all"})
    run = {**TOOLS_RUN, "model": {**TOOLS_RUN["model"], "random": {**TOOLS_RUN["model"]["random"], "preset": "tiny-moe"},
                                  "moe": {"router_replay": "rollout"}},
           "rollout": {**TOOLS_RUN["rollout"], "num_generations": 4},
           "train": {**TOOLS_RUN["train"], "prompts_per_step": 2,
                     "advantage": {"credit": "turn", "reward_turns": {"l": "last"}},
                     # Bins of two longest conversations: some bin holds more than one.
                     "packing": {"bin_length": 1280}},
           "checkpoint": {"every_n_steps": 0, "at_end": False}, "logging": {"progress_bar": False, "plot": False}}
    trainer = Trainer(load_config(run, []), tmp_path)
    scored, rows, batches = [], [], []  # the update's rows (before packing), the batch it ran on
    score, row_batch, update = trainer.collector._score, trainer.row_batch, trainer.update
    monkeypatch.setattr(trainer.collector, "_score", lambda *a, **k: scored.append(score(*a, **k)) or scored[-1])
    monkeypatch.setattr(trainer, "row_batch", lambda *a: rows.append(row_batch(*a)) or rows[-1])
    monkeypatch.setattr(trainer, "update", lambda *a: batches.append(a[2]) or update(*a))
    metrics = trainer.train_step()
    [(_, per_fn, *_)], [ub], [packed] = scored, jax.device_get(rows), jax.device_get(batches)
    own = np.asarray(ub.loss_mask)
    routed, real = np.asarray(ub.routed_experts), np.asarray(ub.mask)
    fed = np.arange(real.shape[1])[None] < (real.sum(1) - 1)[:, None]  # all but each row's last token
    assert (routed[fed] >= 0).all() and (routed[~fed] == -1).all() and (fed & (own == 0) & (real == 1)).any()
    assert metrics["moe/routing_agreement"] == 1.0 and metrics["logprob_gap/sampler_trainer"] < 1e-5
    assert np.asarray(ub.advantages).shape == own.shape and (own.sum(1) > 0).all()

    def group_adv(r):  # GRPO's, by hand: (r - group mean) / (group std + 1e-4); equal rewards 0
        g = np.asarray(r, np.float64).reshape(-1, 4)
        adv = np.where(np.ptp(g, axis=1, keepdims=True) == 0, 0.0, (g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4))
        return adv.reshape(-1)

    scopes = {"f": "first", "l": "last"}  # the task's, then the config's
    comp = {s: sum(w * per_fn[n] for n, w in weights.items() if scopes.get(n, "all") == s) for s in ("all", "first", "last")}
    adv = {s: group_adv(v) for s, v in comp.items()}
    want = np.zeros(own.shape)
    for b, row in enumerate(own):
        starts = [t for t in range(len(row)) if row[t] and (t == 0 or not row[t - 1])]
        assert len(starts) == 2  # the model's first turn, the tool's reply, the model's last turn
        for t in np.flatnonzero(row):
            turn = sum(s <= t for s in starts) - 1
            want[b, t] = adv["all"][b] + (turn == 0) * adv["first"][b] + (turn == 1) * adv["last"][b]
    np.testing.assert_allclose(np.asarray(ub.advantages), want, rtol=1e-4, atol=1e-5)
    assert np.abs(want).max() > 0.1  # the step's rewards had a spread to credit
    _assert_packed_as_rows(trainer._packing[0], ub, packed)
    with pytest.raises(ConfigError, match=r"train\.advantage\.reward_turns: .*'answer'.*its rewards are a, f, l, overlong") as err:
        load_config(run, ["train.advantage.reward_turns.answer=last"])
    assert err.value.exit_code == 2


@pytest.mark.slow
def test_trainer_with_tools_that_raise_hang_flood_or_return_objects(tmp_path, monkeypatch):
    """One short step whose every row makes four tool calls (scripted: a random model never
    writes a call): one raises, one hangs past ``rollout.tool_timeout_s``, one floods, one
    returns a dict. The run goes on, errors and timeouts are counted, the sampler's
    log-probs match the trainer's on the model's tokens, samples carry the turns, the plot
    has the tool-call panel."""
    import json

    from grpo.core.config import load_config
    from grpo.engine.runs import metrics as metrics_mod
    from grpo.engine.runs.metrics import read_metrics
    from grpo.engine.trainer import Trainer
    from grpo.engine.rollout.tools import environment as _environment

    script_calls(monkeypatch, MODES)
    monkeypatch.setattr(_environment, "MAX_RESULT_CHARS", 30)
    titles = []

    def capture(fig, out, **kw):
        titles.extend(ax.get_title() for ax in fig.axes)
        return out

    monkeypatch.setattr(metrics_mod.rundir, "write_figure", capture)
    trainer = Trainer(load_config(TOOLS_RUN, []), tmp_path)
    trainer.run()
    rows = read_metrics(tmp_path)
    [row] = rows
    assert_glossary(row, "Multi-turn tasks and tools")  # issue 52: the metrics glossary, both ways
    assert row["tools/calls_per_sample"] == 4.0
    assert row["tools/errors"] == 16.0 and row["tools/timeouts"] == 16.0  # every row's raise and hang
    assert row["tools/truncated"] == 16.0  # every row's flood
    assert row["turns/mean"] == 2.0
    assert row["time/train/tools_s"] >= 0.3 and row["time/train/append_s"] > 0
    # The trainer's log-probs of the model's tokens (tool replies between them) are the sampler's.
    assert row["logprob_gap/sampler_trainer"] < 1e-4 and np.isfinite(row["loss"])
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # Each completion's tokens (the tool replies included) and the prompt's: a length
    # profile for `grpo plan --lengths samples.jsonl`.
    from grpo.engine.planning.profiles import load_profile

    lengths = samples[0]["completion_lengths"]
    assert len(lengths) == len(samples[0]["completions"]) and min(lengths) >= 1
    assert samples[0]["prompt_length"] >= 1
    assert list(load_profile(str(tmp_path / "samples.jsonl")).tokens) == lengths
    turns = samples[0]["turns"][0]
    assert [t["role"] for t in turns] == ["assistant"] + ["tool"] * 4 + ["assistant"]
    assert [t["trained"] for t in turns] == [True] + [False] * 4 + [True]
    replies = [t["text"] for t in turns[1:5]]
    assert "ValueError: asked to" in replies[0] and "0.3 s" in replies[1]
    assert replies[2].startswith("7" * 30) and "cut" in replies[2] and json.loads(replies[3]) == {"mode": ["object", 1]}
    assert "tool calls per sample (training rollouts)" in titles


def test_max_turns_below_one_is_a_config_error_naming_the_field():
    from grpo.core.config import load_config
    from grpo.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.max_turns") as err:
        load_config(TOOLS_RUN, ["rollout.max_turns=0"])
    assert err.value.exit_code == 2


def test_a_token_ending_with_the_call_tag_ends_a_turn(tmp_path):
    """The tiny tokenizer holds the lookup call's closing JSON and ``</tool_call>`` as one
    token: it ends a turn as the tag alone does (so does Qwen's tool-prompt footer, whose
    text ends with the tag), and no other token does."""
    from transformers import AutoTokenizer

    from grpo.engine.rollout.conversations import Conversations
    from grpo.models.tiny import LOOKUP_CALL_CLOSE, QWEN_TOOLS_FOOTER, tool_token_ids, write_tiny_tokenizer
    from grpo.plugins.tasks._lookup import LookupOptions, LookupTask

    tok = AutoTokenizer.from_pretrained(write_tiny_tokenizer(tmp_path))
    conv = Conversations(LookupTask(), LookupOptions(), tok, tool_format="qwen", timeout_s=1.0)
    ids = tool_token_ids()
    assert LOOKUP_CALL_CLOSE.endswith("</tool_call>")
    assert conv.turn_stop_ids() == tuple(sorted(ids[t] for t in ("</tool_call>", LOOKUP_CALL_CLOSE, QWEN_TOOLS_FOOTER)))
