"""Built-in tasks: ``gsm8k``, ``math`` (MATH-style ``\\boxed{}`` answers checked by
math-verify), ``arithmetic``, ``lookup`` and ``custom`` (your reward functions by import
path, TRL's convention, on your dataset). ``_verify``: math-verify's answer check and the
strict one beside it.

The task-independent machinery the engine uses with any task is the engine's: prompt
rendering (:mod:`grpo.engine.rollout.prompts`), scoring with a task's reward functions
(:mod:`grpo.engine.rollout.scoring`) and pass@k (:mod:`grpo.engine.eval_metrics`).

Import-light: ``datasets`` is imported only when gsm8k loads data; nothing here imports
JAX or transformers.
"""

from grpo.core.hookspecs import hookimpl
from grpo.plugins.tasks._arithmetic import ArithmeticOptions, ArithmeticTask
from grpo.plugins.tasks._custom import CustomOptions, CustomTask
from grpo.plugins.tasks._gsm8k import GSM8KOptions, GSM8KTask, LoadStats, extract_answer, parse_ground_truth
from grpo.plugins.tasks._lookup import LookupOptions, LookupTask
from grpo.plugins.tasks._math import MathOptions, MathTask

__all__ = [
    "ArithmeticOptions",
    "ArithmeticTask",
    "CustomOptions",
    "CustomTask",
    "GSM8KOptions",
    "GSM8KTask",
    "LoadStats",
    "LookupOptions",
    "LookupTask",
    "MathOptions",
    "MathTask",
    "extract_answer",
    "parse_ground_truth",
]


@hookimpl
def register_tasks(register):
    register(GSM8KTask())
    register(ArithmeticTask())
    register(LookupTask())
    register(MathTask())
    register(CustomTask())
