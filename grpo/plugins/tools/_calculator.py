"""``calculator``: arithmetic on numbers, read with :mod:`ast` and never ``eval``'d.

A model's tool call is untrusted text, so the expression is parsed into a syntax tree and
only numbers, parentheses, ``+ - * / // % **`` and unary ``+``/``-`` are walked; a name,
a call, an attribute or anything else is refused. Sizes are bounded so that no call can
burn the host: the expression is at most :data:`MAX_EXPRESSION_CHARS` characters, every
number (given or computed) at most :data:`MAX_ABS` in magnitude, exponents at most
:data:`MAX_EXPONENT` — ``9**9**9`` is refused before it is computed, not after.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable

MAX_EXPRESSION_CHARS = 200
MAX_ABS = 1e15
MAX_EXPONENT = 64

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_ABS:
        raise ValueError(f"a number in the calculation exceeds {MAX_ABS:g} in magnitude")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right:g} exceeds {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise ValueError("division by zero (0 to a negative power)")
        try:
            result = _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError(f"a number in the calculation exceeds {MAX_ABS:g} in magnitude") from None
        if isinstance(result, complex):
            raise ValueError("a negative number to a fractional power is not a real number")
        return _bounded(result)
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ValueError(f"only numbers, parentheses and + - * / // % ** are allowed, not {what}")


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12 / 5".
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS} are allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    return _format(_evaluate(tree.body))


__all__ = ["MAX_ABS", "MAX_EXPONENT", "MAX_EXPRESSION_CHARS", "calculator"]
