"""Tool calls in a policy's turn, and the built-in tools that answer them.

A model asks for a tool the way its chat template taught it to:

  * Qwen3 (and Qwen2.5, Hermes): one or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
    </tool_call>` blocks anywhere in the turn;
  * Llama-3.1/3.2: the whole turn is one JSON object `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`).

`parse_tool_calls` reads them back; `call_tool` runs one and returns the text of the `tool`
message the environment appends (an error in the call is that text too, for the model to read:
a wrong call is the policy's mistake, not the environment's).

Built-in tools: `calculator` (arithmetic on numbers, evaluated over the expression's syntax
tree: no `eval`, no names, bounded powers) and `python` (the program run in the sandbox of
`data/sandbox.py`, its stdout the result).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import math
import operator
import re
from typing import Any, Callable

from jaxrlhf.data import sandbox


class ToolCallFormat(enum.Enum):
    """How a model writes a tool call (the chat template's convention)."""

    QWEN3 = "qwen3"  # <tool_call>{json}</tool_call> blocks
    LLAMA3 = "llama3"  # the turn is one JSON object with "name" and "parameters"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A turn that tries to call a tool but does not say a well-formed call."""


_QWEN3_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call_of(obj: Any, arguments_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError(f"a tool call is a JSON object with a string 'name', got {obj!r}")
    args = obj.get(arguments_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"{arguments_key} of {obj['name']!r} is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"{arguments_key} of {obj['name']!r} is not an object: {args!r}")
    return ToolCall(obj["name"], args)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call is not JSON ({e}): {text.strip()[:80]!r}") from None
    except RecursionError:  # brackets nested past Python's stack: the policy's fault, not ours
        raise ToolCallError("tool call is JSON nested too deeply") from None


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> list[ToolCall]:
    """The tool calls in one policy turn `text` (decoded, without its end-of-turn token);
    [] when the turn calls no tool (an answer).

    Raises:
      ToolCallError: the turn tries a call (a `<tool_call>` block; for Llama-3 a turn that
        starts with `{` or `<|python_tag|>`) that is not well-formed.
    """
    match fmt:
        case ToolCallFormat.QWEN3:
            blocks = _QWEN3_BLOCK.findall(text)
            if not blocks and "<tool_call>" in text:
                raise ToolCallError("<tool_call> without </tool_call>")
            return [_call_of(_json(b), "arguments") for b in blocks]
        case ToolCallFormat.LLAMA3:
            body = text.strip()
            body = body[len(_PYTHON_TAG):].strip() if body.startswith(_PYTHON_TAG) else body
            if not body.startswith("{"):
                return []
            obj = _json(body)
            key = "parameters" if "parameters" in obj or "arguments" not in obj else "arguments"
            return [_call_of(obj, key)]


# --- built-in tools ------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64  # 10**64 is plenty for arithmetic and keeps a power from eating memory
_MAX_CHARS = 200
_MAX_BITS = 4096  # an integer result's size (about 1,200 digits)


def _evaluate(node: ast.AST) -> int | float:
    match node:
        case ast.Expression(body=body):
            return _evaluate(body)
        case ast.Constant(value=value) if type(value) in (int, float):
            return value
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            a, b = _evaluate(left), _evaluate(right)
            if isinstance(op, ast.Pow) and abs(b) > _MAX_EXPONENT:
                raise ValueError(f"exponent {b} is larger than {_MAX_EXPONENT}")
            value = _BINARY[type(op)](a, b)
            if isinstance(value, int) and value.bit_length() > _MAX_BITS:
                # powers of powers ((99**64)**64)**64... would take seconds and megabytes
                raise ValueError("result too large")
            return value
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_evaluate(operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculate(expression: str) -> str:
    """The value of an arithmetic `expression` (numbers, + - * / // % **, parentheses) as
    text: an integer result without a decimal point.

    Raises:
      ValueError: anything else (names, calls, attributes, a huge power, division by zero).
    """
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"expression longer than {_MAX_CHARS} characters")
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:  # a float power past 1.8e308 (1e300**2); ints are bounded above
        raise ValueError("result too large") from None
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    return str(value)


def run_python(code: str) -> str:
    """`code` run in the sandbox; its stdout, or its status and the last line of stderr."""
    result = sandbox.run_python(code)
    if result.status is sandbox.RunStatus.OK:
        return result.stdout
    last = result.stderr.strip().splitlines()[-1:] or [""]
    return f"{result.status.value}: {last[0]}"


@dataclasses.dataclass(frozen=True)
class Tool:
    """A built-in tool: its function and the one string argument it takes."""

    fn: Callable[[str], str]
    argument: str


BUILTIN_TOOLS = {"calculator": Tool(calculate, "expression"), "python": Tool(run_python, "code")}


def call_tool(call: ToolCall, tools: dict[str, Tool] = BUILTIN_TOOLS) -> str:
    """The text of the `tool` message answering `call`: the tool's result, or
    "error: ..." when the call names no such tool, lacks its argument or the tool refuses it."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool {call.name!r} (tools: {', '.join(sorted(tools))})"
    argument = call.arguments.get(tool.argument)
    if not isinstance(argument, str):
        return f"error: {call.name} needs a string argument {tool.argument!r}"
    try:
        return tool.fn(argument)
    except ValueError as e:
        return f"error: {e}"
