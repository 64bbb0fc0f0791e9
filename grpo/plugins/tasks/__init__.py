"""Built-in tasks: ``gsm8k``, ``arithmetic`` and ``lookup``, and the task-independent helpers the
engine uses with any task.

::

    from grpo.plugins.tasks import render_prompt, score_completions, evaluate_completions

    prompt = render_prompt(task, options, example, tokenizer)        # str
    scores = score_completions(task, options, examples, completions)  # Scores
    result = evaluate_completions(task, options, examples, groups)    # pass@k, mean@n

Import-light: ``datasets`` is imported only when gsm8k loads data; nothing here imports
JAX or transformers.
"""

from grpo.core.hookspecs import hookimpl
from grpo.plugins.tasks._arithmetic import ArithmeticOptions, ArithmeticTask
from grpo.plugins.tasks._evaluation import EvalResult, evaluate_completions, group_metrics, mean_correct, pass_at_k
from grpo.plugins.tasks._gsm8k import GSM8KOptions, GSM8KTask, LoadStats, extract_answer, parse_ground_truth
from grpo.plugins.tasks._lookup import LookupOptions, LookupTask
from grpo.plugins.tasks._prompts import render_messages, render_prompt, render_prompts
from grpo.plugins.tasks._scoring import OVERLONG, Scores, overlong_penalty, reward_weights, score_completions

__all__ = [
    "OVERLONG",
    "ArithmeticOptions",
    "ArithmeticTask",
    "EvalResult",
    "GSM8KOptions",
    "GSM8KTask",
    "LoadStats",
    "LookupOptions",
    "LookupTask",
    "Scores",
    "evaluate_completions",
    "reward_weights",
    "extract_answer",
    "group_metrics",
    "mean_correct",
    "overlong_penalty",
    "parse_ground_truth",
    "pass_at_k",
    "render_messages",
    "render_prompt",
    "render_prompts",
    "score_completions",
]


@hookimpl
def register_tasks(register):
    register(GSM8KTask())
    register(ArithmeticTask())
    register(LookupTask())
