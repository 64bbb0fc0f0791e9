"""Math answers checked by Hugging Face's ``math-verify`` (the ``[math]`` extra), and the
strict string check beside it.

``math-verify`` parses both sides into SymPy and compares them, so ``1/2``, ``0.5``,
``\\frac{1}{2}`` and ``50\\%`` of 1 are one answer, ``1,234`` is ``1234``, ``2\\text{ cm}``
is ``2`` and ``x=2`` answers ``2``. Both sides are parsed as the content of a
``\\boxed{}`` (math-verify's strongest anchor): an answer written without LaTeX
delimiters parses as LaTeX too.

Its own timeouts use ``signal.alarm``, which works only on a process's main thread; grpo
calls rewards on worker threads when asked to (``task.reward_timeout_s``,
``reward_threads``, ``reward_scoring: overlap``), so they are turned off here and the
reward's call is bounded by ``task.reward_timeout_s`` instead.

:func:`normalize` is the strict check's normal form: a ``\\boxed{}`` content with
spaces, ``\\left``/``\\right``, ``\\!``, ``\\,``, ``$`` and a trailing period removed
and ``\\dfrac``/``\\tfrac`` read as ``\\frac``: two answers match strictly when their
normal forms are the same string.
"""

from __future__ import annotations

import functools
import logging
import re

from grpo.core.errors import UserError

INSTALL = 'pip install "grpo-jax[math]" (Hugging Face\'s math-verify)'


@functools.lru_cache(maxsize=1)
def _math_verify():
    import importlib

    try:
        math_verify = importlib.import_module("math_verify")  # the [math] extra
    except ImportError:
        return None
    # It warns on every call that its own timeouts are off (they are: see the module docstring).
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


def available() -> bool:
    """Whether ``math-verify`` is installed."""
    return _math_verify() is not None


def require(field: str) -> None:
    """A UserError naming ``field`` when ``math-verify`` is not installed."""
    if not available():
        raise UserError(f"{field}: math_verify checks answers with Hugging Face's math-verify, which is not "
                        f"installed; {INSTALL}, or choose strict.")


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple:
    mv = _math_verify()
    return tuple(mv.parse("$\\boxed{" + text + "}$", parsing_timeout=None))


def equivalent(gold: str, answer: str) -> bool:
    """Whether math-verify finds ``answer`` equal to ``gold`` (both answers' texts, e.g.
    the contents of their ``\\boxed{}``); False when either does not parse."""
    mv = _math_verify()
    if mv is None:
        raise RuntimeError(f"math-verify is not installed: {INSTALL}")
    g, a = _parse(gold.strip()), _parse(answer.strip())
    if not g or not a:
        return False
    return bool(mv.verify(list(g), list(a), timeout_seconds=None))


def equivalent_text(gold: str, text: str) -> bool:
    """Whether math-verify finds the answer it extracts from free ``text`` (a whole
    completion: its last boxed or LaTeX or plain expression) equal to ``gold``."""
    mv = _math_verify()
    if mv is None:
        raise RuntimeError(f"math-verify is not installed: {INSTALL}")
    g = _parse(gold.strip())
    a = mv.parse(text, parsing_timeout=None)
    return bool(g and a and mv.verify(list(g), a, timeout_seconds=None))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces
    balanced; None when there is none (or it is never closed)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i]
    return None


_DROP = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s+")


def normalize(answer: str) -> str:
    """The strict check's normal form of an answer's text (see the module docstring)."""
    out = _DROP.sub("", answer)
    out = out.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return out.rstrip(".")


__all__ = ["INSTALL", "available", "equivalent", "equivalent_text", "last_boxed", "normalize", "require"]
