"""The metrics glossary (docs/reference/metrics.md) against what runs log (issue 52: "the
metrics glossary is tested both ways").

The page has one section (``## Title``) per feature, each a table of ``| `key` | unit |
meaning |`` rows; ``<name>``-style parts of a key match one path segment (``reward/<name>/mean``
matches ``reward/correct/mean``).

- Every key a run logs is documented: :func:`assert_glossary` checks a run's rows (or the
  dict of metrics a producer hands the row) against every entry of the page.
- Every documented key is logged: :func:`assert_glossary` also checks that the rows log
  every key of the sections it is told the rows cover, and :data:`SECTION_RUNS` names, for
  each section, the existing test run that makes that claim (a test of its own checks
  that each of those tests calls :func:`assert_glossary` with its section). A section no
  fixture run reaches names what logs it instead (:data:`LOGGED_ELSEWHERE`), and its keys
  must be in the code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "metrics.md"


class Entry(NamedTuple):
    section: str
    key: str
    unit: str
    meaning: str

    @property
    def pattern(self) -> re.Pattern[str]:
        parts = re.split(r"(<[^>/]+>)", self.key)
        return re.compile("".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts) + r"\Z")


def entries(text: str | None = None) -> list[Entry]:
    """Every row of the glossary's tables, with the section it sits in."""
    text = PAGE.read_text() if text is None else text
    out, section = [], ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"^\| `([^`]+)` \| ([^|]*) \| (.*) \|\s*$", line)
        if m:
            out.append(Entry(section, m.group(1), m.group(2).strip(), m.group(3).strip()))
    return out


def sections(text: str | None = None) -> list[str]:
    return list(dict.fromkeys(e.section for e in entries(text)))


def undocumented(keys: Iterable[str], glossary: list[Entry] | None = None) -> list[str]:
    glossary = entries() if glossary is None else glossary
    return sorted(k for k in set(keys) if not any(e.pattern.match(k) for e in glossary))


def unlogged(keys: Iterable[str], covered: Iterable[str], glossary: list[Entry] | None = None) -> list[str]:
    """The keys of sections ``covered`` that none of ``keys`` matches."""
    glossary = entries() if glossary is None else glossary
    keys = set(keys)
    return [e.key for e in glossary if e.section in set(covered) and not any(e.pattern.match(k) for k in keys)]


def assert_glossary(rows: Mapping[str, Any] | Iterable[Mapping[str, Any]], *covered: str) -> None:
    """Every key of ``rows`` (metrics rows, or one dict of metrics) is on the glossary page,
    and the rows log every key of the sections named ``covered``."""
    rows = [rows] if isinstance(rows, Mapping) else list(rows)
    keys = set().union(*(r.keys() for r in rows))
    glossary = entries()
    known = {e.section for e in glossary}
    assert set(covered) <= known, f"no such glossary section: {sorted(set(covered) - known)}"
    missing = undocumented(keys, glossary)
    assert not missing, f"logged but not in docs/reference/metrics.md: {missing}"
    absent = unlogged(keys, covered, glossary)
    assert not absent, f"docs/reference/metrics.md documents {absent} under {covered}, but this run does not log them"


# The existing test run that logs each section's keys (and calls assert_glossary with it).
SECTION_RUNS = {
    "Every step": "tests/engine/test_trainer.py::test_one_step_every_style_and_loss",
    "Entropy": "tests/engine/test_trainer.py::test_one_step_every_style_and_loss",
    "Sequence packing": "tests/engine/test_trainer.py::test_one_step_every_style_and_loss",
    "Evaluation": "tests/engine/test_trainer.py::test_recipe_precision_beta_ppo_epochs_tis_eval_wandb_offline_and_resume",
    "Mixture of experts": "tests/integration/test_moe_replay.py::test_a_tiny_moe_run_replays_routing_and_logs_it",
    "Mismatch correction": "tests/engine/test_trainer.py::test_recipe_precision_beta_ppo_epochs_tis_eval_wandb_offline_and_resume",
    "Mismatch correction, mask mode": "tests/plugins/losses/test_packed_loss.py::test_packed_equals_padded",
    "Truncated policy": "tests/engine/test_trainer.py::test_truncated_policy_makes_the_top_p_weights_one",
    "Objective gspo": "tests/plugins/losses/test_packed_loss.py::test_packed_equals_padded",
    "Objective cispo": "tests/plugins/losses/test_packed_loss.py::test_packed_equals_padded",
    "Objective sapo": "tests/plugins/losses/test_packed_loss.py::test_packed_equals_padded",
    "Dynamic sampling":
        "tests/engine/test_trainer.py::test_dynamic_sampling_trains_only_groups_with_a_reward_spread_and_resumes_bitwise",
    "Dynamic sampling, streamed":
        "tests/engine/rollout/test_step.py::test_streamed_batch_is_the_informative_groups_in_finish_order",
    "Down-sampling": "tests/engine/test_trainer.py::test_down_sampling_trains_on_the_max_variance_subset",
    "Asynchronous GRPO": "tests/engine/loop/test_loop.py::test_staleness_zero_equals_the_synchronous_run",
    "Partial rollouts":
        "tests/engine/rollout/test_partial.py::test_a_preempted_partial_run_keeps_its_rows_in_flight",
    "Multi-turn tasks and tools":
        "tests/engine/rollout/test_multiturn.py::test_trainer_with_tools_that_raise_hang_flood_or_return_objects",
    # The producers of what the trainer adds to the row: a CPU run logs no memory, and a
    # failure's row needs a reward that fails.
    "Reward failures": "tests/engine/rollout/test_failures.py::test_a_judges_parse_failures_count_on_their_own",
    "Accelerator memory": "tests/engine/runs/test_metrics.py::test_metrics_logger_and_plot",
}

# Sections whose keys no fixture run logs yet, with what logs them.
LOGGED_ELSEWHERE: dict[str, str] = {}

# Keys documented ahead of the code that logs them (the section above): a test fails once
# the code has them, so that they move to the section of the run that logs them.
AWAITING_MERGE: set[str] = set()
