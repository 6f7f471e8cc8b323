"""A calculator tool: the policy writes an arithmetic expression followed by ``=``, the tool appends
its value, and the policy goes on (to its answer and EOS, or to another expression).

    the product is 347*23= 7981        <- "347*23=" sampled by the policy, " 7981" the observation

The expression is the longest run of digits, spaces, ``+ - * / ( ) .`` before the ``=``; it is
evaluated by walking its Python AST (numbers, the four operations, ``//``, ``%``, unary minus,
parentheses; never ``eval``), with operands and results bounded (``MAX_MAGNITUDE``) so no call
can run long or build a huge number. An expression it cannot read gives the observation `` ?``. The
episode ends when the policy ends its answer line (a newline), samples EOS, or at ``--env.max-turns``.
"""

from __future__ import annotations

import ast
import operator
import re

from llamarl.data.prompts import Problem
from llamarl.environments.base import Turn, register_environment

MAX_MAGNITUDE = 10**15
_EXPRESSION = re.compile(r"([0-9+\-*/().%\s]*[0-9)][0-9+\-*/().%\s]*)=\s*$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate(expression: str) -> float:
    """The value of an arithmetic ``expression``; ValueError for anything else, a division by zero,
    or a magnitude above ``MAX_MAGNITUDE``."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            value = _OPERATORS[type(node.op)](left, right)
        else:
            raise ValueError(f"unsupported syntax in {expression!r}")
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError(f"magnitude above {MAX_MAGNITUDE}")
        return value

    return walk(tree)


def format_value(value: float) -> str:
    """Integers as integers; other values rounded to 6 decimals, trailing zeros dropped."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0").rstrip(".")


@register_environment("calculator")
class CalculatorEnvironment:
    """See the module docstring."""

    def stop_texts(self) -> list[str]:
        return ["="]

    def end_texts(self) -> list[str]:
        return ["\n"]  # the answer line is complete

    def reset(self, problem: Problem) -> dict:
        return {"calls": 0}

    def step(self, state: dict, turn: str) -> Turn:
        match = _EXPRESSION.search(turn)
        calls = int(state.get("calls", 0)) + 1
        if match is None:
            return Turn(observation=" ?", state={"calls": calls})
        try:
            text = " " + format_value(evaluate(match.group(1)))
        except ValueError:
            text = " ?"
        return Turn(observation=text, state={"calls": calls})
