"""Issue 55, rewards at scale: batched reward functions (TRL's convention), calls on a worker
pool with timeouts, faults that score 0 and are counted, and scores that do not depend on
the order calls finish in (:mod:`grpo.engine.rollout.scoring`, :mod:`grpo.engine.rollout.reward_pool`)."""

from __future__ import annotations

import functools
import random
import threading
import time
from typing import ClassVar

import pytest

from grpo.core.contracts import NoOptions, TaskPlugin, batched_reward, reward_batch
from grpo.engine.rollout.reward_pool import RewardPool, RewardTimeout
from grpo.engine.rollout.scoring import RewardScorer, call_batched, score_completions


def _examples(n_prompts: int, k: int) -> list[dict]:
    return [{"question": f"q{p}", "answer": str(p)} for p in range(n_prompts) for _ in range(k)]


class TwinTask(TaskPlugin):
    """The same rewards per completion and batched: `hit` (the answer in the completion)
    and `short` (NaN past 6 characters: not applicable); `rank` batched per group (the
    completion's rank by length within its group). Counts the batched calls."""

    name: ClassVar[str] = "twin"
    Options = NoOptions

    def __init__(self, batched: bool):
        self.batched = batched
        self.calls: list[int] = []  # rows per batched call
        self.group_calls: list[list[str]] = []

    def load(self, *, split, options, seed=0):
        return _examples(2, 2)

    def prompt_messages(self, example, *, options):
        return [{"role": "user", "content": example["question"]}]

    def reward_functions(self, *, options):
        def hit(c, ex):
            return float(ex["answer"] in c)

        def short(c, ex):
            return float("nan") if len(c) > 6 else len(c) / 6

        @batched_reward(per="group")
        def rank(completions, prompts, question):
            assert len(set(question)) == 1 and all(p == [{"role": "user", "content": question[0]}] for p in prompts)
            self.group_calls.append(list(completions))
            order = sorted(range(len(completions)), key=lambda i: (len(completions[i]), i))
            return [order.index(i) / max(len(completions) - 1, 1) for i in range(len(completions))]

        if not self.batched:
            return {"hit": hit, "short": short, "rank": rank}

        @batched_reward
        def hit_b(completions, prompts, answer, **columns):
            assert "question" in columns  # every column, as keyword lists
            self.calls.append(len(completions))
            return [float(a in c) for c, a in zip(completions, answer)]

        @batched_reward
        def short_b(completions, **columns):
            return [None if len(c) > 6 else len(c) / 6 for c in completions]

        hit_b.__name__, short_b.__name__ = "hit", "short"
        return {"hit": hit_b, "short": short_b, "rank": rank}


COMPLETIONS = ["0", "the answer is 0", "1!", "it is 11", "22", "x", "abc1", "nope"]


def test_batched_rewards_are_called_once_per_step_and_equal_their_per_completion_twin():
    """The goal: a step-batched reward is called once for the step's rows (counted); a
    group-batched one once per group, with that group's rows; the scores equal the
    per-completion twin's, not-applicable counts included."""
    batched, single = TwinTask(batched=True), TwinTask(batched=False)
    examples = _examples(4, 2)
    a = RewardScorer(batched, NoOptions(), group_size=2).score(examples, COMPLETIONS)
    b = RewardScorer(single, NoOptions(), group_size=2).score(examples, COMPLETIONS)
    assert batched.calls == [8]
    assert batched.group_calls == [COMPLETIONS[i:i + 2] for i in range(0, 8, 2)]
    assert a == b
    assert a.not_applicable["short"] == 2 and a.rewards[1]["hit"] == 1.0 and a.rewards[3]["hit"] == 1.0
    assert [r["rank"] for r in a.rewards[:2]] == [0.0, 1.0]


def test_a_group_without_a_size_is_a_run_of_equal_examples():
    task = TwinTask(batched=True)
    score_completions(task, NoOptions(), _examples(3, 2), COMPLETIONS[:6])
    assert [len(c) for c in task.group_calls] == [2, 2, 2]


def test_batched_reward_marks_and_refuses():
    def f(completions, **kw):
        return [1.0] * len(completions)

    assert reward_batch(f) is None
    assert reward_batch(batched_reward(f)) == "step" and reward_batch(batched_reward(per="group")(f)) == "group"
    with pytest.raises(ValueError, match="per must be one of"):
        batched_reward(per="row")


def test_call_batched_passes_only_named_columns_and_checks_the_length():
    seen = {}

    def named(completions, prompts, answer):
        seen.update(answer=answer)
        return (1, 2)

    assert call_batched(named, ["a", "b"], [[], []], {"answer": ["1", "2"], "other": [0, 0]}) == [1, 2]
    assert seen == {"answer": ["1", "2"]}
    with pytest.raises(ValueError, match="returned 2 value\\(s\\) for 3 completion"):
        call_batched(named, ["a", "b", "c"], [[]] * 3, {"answer": [1, 2, 3]})
    with pytest.raises(TypeError, match="returned str"):
        call_batched(lambda completions, prompts: "1", ["a"], [[]], {})


class FaultyTask(TaskPlugin):
    """`ok` works; `hang` hangs on 'h'; `boom` (batched per step) raises when a
    completion holds 'x' (then row by row: only that row fails); `nan` NaN on 'n';
    `short` (batched) returns one value too few on every call."""

    name: ClassVar[str] = "faulty"
    Options = NoOptions

    def __init__(self):
        self.release = threading.Event()

    def load(self, *, split, options, seed=0):
        return [{"question": "q"}]

    def prompt_messages(self, example, *, options):
        return [{"role": "user", "content": example["question"]}]

    def reward_functions(self, *, options):
        release = self.release

        def ok(c, ex):
            return 1.0

        def hang(c, ex):
            if "h" in c:
                release.wait(30)
            return 0.5

        @batched_reward
        def boom(completions, **kw):
            if any("x" in c for c in completions):
                raise KeyError("x")
            return [1.0] * len(completions)

        def nan(c, ex):
            return float("nan") if "n" in c else 1.0

        @batched_reward
        def short(completions, **kw):
            return [1.0] * (len(completions) - 1)

        return {"ok": ok, "hang": hang, "boom": boom, "nan": nan, "short": short}


def test_hanging_raising_nan_and_wrong_length_rewards_score_zero_counted_and_scoring_goes_on():
    """Issue 55 faults: a hung call times out (counted in timeouts, not errors) and the
    calls behind it still run; a raising step-batched call is retried row by row; NaN is
    not applicable; a wrong length fails every row of its calls."""
    task = FaultyTask()
    scorer = RewardScorer(task, NoOptions(), timeout_s=0.3)
    completions = ["a", "h1", "x", "n", "h2", "b"]
    t0 = time.monotonic()
    try:
        s = scorer.score([{"question": "q"}] * 6, completions)
    finally:
        task.release.set()
    assert time.monotonic() - t0 < 5  # two hung calls, each past 0.3 s: nothing waited on them
    assert s.timeouts == {"ok": 0, "hang": 2, "boom": 0, "nan": 0, "short": 0}
    assert s.errors == {"ok": 0, "hang": 0, "boom": 1, "nan": 0, "short": 6}
    assert s.timed_out[1] == ("hang",) and s.timed_out[4] == ("hang",) and s.failed[2] == ("boom", "short")
    assert [r["hang"] for r in s.rewards] == [0.5, 0.0, 0.5, 0.5, 0.0, 0.5]
    assert [r["boom"] for r in s.rewards] == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert s.not_applicable["nan"] == 1 and s.errors["nan"] == 0
    assert s.first_errors["hang"].startswith("RewardTimeout: the reward did not answer within 0.3 s")
    assert s.first_error_rows == {"hang": 1, "boom": 2, "short": 0}
    assert scorer.calls["boom"] == 1 + 6  # the step's call, then row by row
    m = s.metrics()
    assert m["reward/hang/timeouts"] == 2.0 and m["reward/short/errors"] == 6.0


def test_pool_runs_one_functions_calls_in_series_and_different_functions_side_by_side():
    pool = RewardPool(timeout_s=None, threads=1)
    active, peak = {"a": 0, "b": 0}, {"a": 0, "b": 0}
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=5)

    def call(lane):
        def run():
            with lock:
                active[lane] += 1
                peak[lane] = max(peak[lane], active[lane])
            try:
                both.wait()  # an "a" and a "b" call run at once, or this times out
            except threading.BrokenBarrierError:
                pass
            time.sleep(0.01)
            with lock:
                active[lane] -= 1
            return lane
        return run

    futures = [pool.submit(lane, call(lane)) for lane in ("a", "b") for _ in range(3)]
    assert [f.result(10) for f in futures] == ["a"] * 3 + ["b"] * 3
    assert peak == {"a": 1, "b": 1} and not both.broken


def test_a_timed_out_call_frees_its_slot_for_the_next():
    pool = RewardPool(timeout_s=0.2, threads=1)
    gate = threading.Event()
    hung = pool.submit("r", lambda: gate.wait(30))
    later = pool.submit("r", lambda: 7)
    with pytest.raises(RewardTimeout):
        hung.result(5)
    assert later.result(5) == 7 and pool.timeouts == 1
    gate.set()


def test_scores_do_not_depend_on_the_order_groups_are_started_or_finish():
    """Async scoring's determinism: the groups of a step started in any order, their
    calls finishing in any order (random sleeps on 4 threads), give the scores of one
    call on the whole step, row for row."""
    task = TwinTask(batched=False)
    examples = _examples(4, 2)
    reference = RewardScorer(task, NoOptions(), group_size=2).score(examples, COMPLETIONS)
    rng = random.Random(0)

    class Jittery(TwinTask):
        def reward_functions(self, *, options):
            fns = super().reward_functions(options=options)

            def slow(fn):
                @functools.wraps(fn)  # the signature (the columns it takes) and the batch mark
                def call(*args, **kwargs):
                    time.sleep(rng.random() * 0.01)
                    return fn(*args, **kwargs)
                return call

            return {n: slow(f) for n, f in fns.items()}

    for trial in range(3):
        scorer = RewardScorer(Jittery(batched=False), NoOptions(), threads=4, group_size=2)
        groups = list(range(4))
        rng.shuffle(groups)
        parts = [scorer.start(examples[2 * g:2 * g + 2], COMPLETIONS[2 * g:2 * g + 2], rows=[2 * g, 2 * g + 1])
                 for g in groups]
        assert scorer.collect(parts) == reference, trial


def test_per_completion_rewards_start_row_by_row_and_batched_ones_per_group():
    """Issue 55, item 1 (overlapped scoring starts a row's per-completion rewards as soon as
    it ends, a group's batched one once the group is whole): rows started one by one in a
    shuffled finishing order, each with ``row_names`` only, and each group's ``rank`` (per
    group) in its own part give the scores of one call on the whole step, row for row."""
    task = TwinTask(batched=False)
    examples = _examples(4, 2)
    reference = RewardScorer(task, NoOptions(), group_size=2).score(examples, COMPLETIONS)
    scorer = RewardScorer(TwinTask(batched=False), NoOptions(), threads=2, group_size=2)
    assert scorer.row_names == ("hit", "short")
    rows = list(range(8))
    random.Random(1).shuffle(rows)
    parts, done = [], set()
    for r in rows:
        parts.append(scorer.start([examples[r]], [COMPLETIONS[r]], rows=[r], names=scorer.row_names))
        done.add(r)
        g = r // 2
        if {2 * g, 2 * g + 1} <= done:
            parts.append(scorer.start(examples[2 * g:2 * g + 2], COMPLETIONS[2 * g:2 * g + 2], rows=[2 * g, 2 * g + 1],
                                      names=["rank"]))
    assert scorer.collect(parts) == reference


PROCESS_REWARDS = '''
import os, time

def pid_len(completions, **kw):
    return [len(c) + os.getpid() * 0 for c in completions]

def where(completions, **kw):
    return [float(os.getpid()) for c in completions]

def hang_on_h(completions, **kw):
    if any("h" in c for c in completions):
        time.sleep(60)
    return [1.0] * len(completions)
'''


def test_process_rewards_run_in_child_processes_and_a_hung_child_is_killed(tmp_path, monkeypatch):
    """CPU-heavy rewards in child processes (task.process_rewards): the values equal the
    inline ones, the calls ran in another process, and a call that hangs there times out
    and its child is killed (the next call gets a fresh one). ~3-6 s: each child imports grpo."""
    import os

    from grpo.plugins.tasks import CustomOptions, CustomTask

    (tmp_path / "proc_rewards.py").write_text(PROCESS_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    opts = CustomOptions.model_validate({"rewards": ["proc_rewards:pid_len", "proc_rewards:where",
                                                    "proc_rewards:hang_on_h"]})
    examples, completions = [{"prompt": "p"}] * 3, ["a", "bb", "ccc"]
    inline = RewardScorer(CustomTask(), opts).score(examples, completions)
    scorer = RewardScorer(CustomTask(), opts, timeout_s=20, processes=1,
                          process_rewards=["pid_len", "where", "hang_on_h"])
    try:
        remote = scorer.score(examples, completions)
        assert [r["pid_len"] for r in remote.rewards] == [r["pid_len"] for r in inline.rewards] == [1.0, 2.0, 3.0]
        assert {r["where"] for r in remote.rewards} != {float(os.getpid())}
        scorer.pool.timeout_s = 0.5
        hung = scorer.score(examples, ["h", "b", "c"])
        assert hung.timeouts["hang_on_h"] == 3 and hung.errors["hang_on_h"] == 0 and hung.errors["pid_len"] == 0
        again = scorer.score(examples, completions)  # a fresh child answers
        assert again.timeouts["hang_on_h"] == 0 and [r["hang_on_h"] for r in again.rewards] == [1.0] * 3
    finally:
        scorer.close()


def test_overlapped_scoring_starts_calls_without_waiting_for_them():
    """reward_scoring: overlap puts a run's calls on workers even without a timeout or
    threads (before, its scorer ran them inline: a group's calls ran inside the decode
    loop, which then waited for them); start() returns at once, collect() waits."""
    from _runs import _config

    from grpo.plugins.tasks import ArithmeticTask

    task = ArithmeticTask()
    cfg = _config(**{"task.reward_scoring": "overlap", "rollout.engine": "continuous"})
    opts = task.parse_options(cfg.task.options)
    assert RewardScorer.for_run(cfg, task, opts).pool is not None
    assert RewardScorer.for_run(_config(), task, opts).pool is None  # the default: inline, as before
    # reward_threads: auto (issue 55, item 1): 1 after the rollout (inline), OVERLAP_REWARD_THREADS
    # under overlap, whose calls run on workers anyway; a number is taken as it is.
    from grpo.core.config.schema import OVERLAP_REWARD_THREADS

    assert (cfg.task.reward_threads, _config().task.reward_threads) == ("auto", "auto")
    assert RewardScorer.for_run(cfg, task, opts).pool.threads == OVERLAP_REWARD_THREADS > 1
    assert _config(**{"task.reward_scoring": "overlap", "rollout.engine": "continuous",
                      "task.reward_threads": 3}).task.reward_workers == 3
    assert _config(**{"task.reward_threads": 3}).task.reward_workers == 3 and _config().task.reward_workers == 1

    class Slow(TwinTask):
        def reward_functions(self, *, options):
            def slow(c, ex):
                time.sleep(0.4)
                return 1.0
            return {"slow": slow}

    scorer = RewardScorer(Slow(batched=False), NoOptions(), background=True)
    t0 = time.monotonic()
    part = scorer.start([{"question": "q"}] * 3, ["a", "b", "c"])
    started = time.monotonic() - t0
    assert [r["slow"] for r in scorer.collect([part]).rewards] == [1.0] * 3
    assert started < 0.3 < 1.2 <= time.monotonic() - t0 + 0.01  # three calls of 0.4 s, in series
