r"""``tinker/MathTool-v0``: math word problems with a ``python`` and a ``calculator`` tool, over several turns."""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Sequence

from tinkergym.core import StepResult
from tinkergym.errors import ConfigError, SandboxUnavailableError
from tinkergym.tools import ParsedToolCalls, Tool, ToolBox, function_schema, parse_tool_calls

from tinkergym_math.calculator import calculate
from tinkergym_math.data import printable
from tinkergym_math.env import MathEnv, feedback, grade_info
from tinkergym_math.grading import grade
from tinkergym_math.sandbox import ISOLATIONS, check_sandbox, run_python

TOOL_NAMES = ("python", "calculator")
#: A call of each tool, as the system prompt shows it (the example names a tool the env offers).
_CALL_EXAMPLES = {
    "calculator": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4) / 5"}}</tool_call>',
    "python": '<tool_call>{"name": "python", "arguments": {"code": "print(12 * (3 + 4) / 5)"}}</tool_call>',
}


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: choose an integer from {low} to {high}.")
    return value


class MathToolEnv(MathEnv):
    r"""Multi-turn math word problems where the model may call tools before it answers.

    Tools (schemas in ``info["tools"]`` on reset, ready for a chat template's ``tools=``):
    ``calculator(expression)`` evaluates arithmetic exactly from its syntax tree (no ``eval``);
    ``python(code)`` runs code with the system's ``python3`` under bubblewrap (:mod:`tinkergym.sandbox`:
    new namespaces as an unprivileged uid, a read-only ``/usr`` and nothing else of the host, a size-capped
    tmpfs as working folder, no network, time/memory/process/file limits; nothing outlives a call) and
    returns what it printed (a final bare expression is printed too).

    Observation: on reset, the problem, the tools and the number of tool calls allowed. After a message
    with tool calls, one ``<tool_response>\n...\n</tool_response>`` block per call, in order (malformed
    calls get an ``Error: ...`` block that shows the expected form), then how many calls and turns are
    left. After the final answer, the same feedback as ``tinker/Math-v0``.
    Action: a message. Tool calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
    (also plain JSON calls, see :func:`tinkergym.tools.parse_tool_calls`). A message without tool calls
    is the final answer, graded like ``tinker/Math-v0`` (LAST ``\boxed{}``, else an ``Answer:`` line).
    Reward: 0 on tool turns; on the final answer 1 if correct, else 0, plus ``format_reward`` for a
    well-formed ``\boxed{}`` number. A non-text or over-long action ends the episode with 0.
    Termination: when the final answer is graded. At most ``max_tool_calls`` calls run per episode:
    calls past the limit in a message are not run (their blocks say so), and once the limit is used up
    the next message is graded as the final answer whatever it contains. The ``max_turns``-th message
    is likewise always graded as the final answer (the observation before it says it is the last turn).
    Never truncated.

    ``info`` on tool turns: ``tool_calls`` (``[{"name", "arguments"}]``, arguments as a JSON string),
    ``tool_results`` (``[{"name", "content"}]``, for building ``role="tool"`` messages), ``tool_errors``,
    ``tool_calls_used``, ``tool_calls_left``, ``turn``. On the final answer: as ``tinker/Math-v0`` plus
    ``tool_calls_used`` and ``turn``.

    Args:
        data_files, split, format_reward, shuffle, render_mode: as for ``tinker/Math-v0``.
        max_tool_calls: Tool calls run per episode (default 4; 0 to 50).
        max_turns: Messages per episode, the final answer included (default 8; 1 to 50).
        tools: Which tools to offer, a subset of ``("python", "calculator")`` (default both).
        python_timeout: Wall-clock seconds per ``python`` call (default 5; up to 60).
        python_memory_mb: Address-space limit of a ``python`` call in MiB (default 512).
        max_tool_output: Characters of each tool result shown (default 2,000).
        python_sandbox: ``"bubblewrap"`` (default): the env refuses to be made where bubblewrap cannot run,
            with a message that says how to install it. ``"rlimits"`` opts in to a weaker guard (a plain
            subprocess with the same limits, never as root) that is NOT a security boundary.
        python_executable: The interpreter tool code runs with (default: the system's ``python3``); the
            sandbox's unprivileged user must be able to read it.

    Determinism: the same seed and messages give the same episode as long as the code given to the
    ``python`` tool is deterministic (it runs in a fresh process each call).
    """

    metadata = {**MathEnv.metadata, "tinkergym": {"data": "dataset", "turns": "multi", "agents": 1}}

    def __init__(
        self,
        data_files: Any = None,
        split: str = "train",
        format_reward: float = 0.0,
        shuffle: bool = True,
        max_tool_calls: int = 4,
        max_turns: int = 8,
        tools: Sequence[str] = TOOL_NAMES,
        python_timeout: float = 5.0,
        python_memory_mb: int = 512,
        max_tool_output: int = 2_000,
        python_sandbox: str = "bubblewrap",
        python_executable: str | None = None,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(data_files=data_files, split=split, format_reward=format_reward, shuffle=shuffle, render_mode=render_mode)
        self.max_tool_calls = _check_int("max_tool_calls", max_tool_calls, 0, 50)
        self.max_turns = _check_int("max_turns", max_turns, 1, 50)
        self.python_memory_mb = _check_int("python_memory_mb", python_memory_mb, 64, 16_384)
        self.max_tool_output = _check_int("max_tool_output", max_tool_output, 100, 10_000)
        if isinstance(python_timeout, bool) or not isinstance(python_timeout, (int, float)) or not 0 < python_timeout <= 60:
            raise ConfigError(f"python_timeout={python_timeout!r}: choose a number of seconds above 0 and at most 60.")
        self.python_timeout = float(python_timeout)
        names = [tools] if isinstance(tools, str) else list(tools) if isinstance(tools, (list, tuple)) else None
        if not names or any(name not in TOOL_NAMES for name in names) or len(set(names)) != len(names):
            raise ConfigError(f"tools={tools!r}: choose one or both of {list(TOOL_NAMES)}.")
        if python_sandbox not in ISOLATIONS:
            raise ConfigError(f"python_sandbox={python_sandbox!r}: choose 'bubblewrap' (the default) or 'rlimits' (weaker, not a security boundary).")
        self.python_sandbox, self.python_executable = python_sandbox, python_executable
        if "python" in names:  # fail here, once, rather than in every tool call of a training run
            try:
                self.python_executable = check_sandbox(python_sandbox, python_executable)
            except ConfigError as exc:
                raise ConfigError(f"python_executable={python_executable!r}: {exc}") from exc
            except SandboxUnavailableError as exc:
                raise SandboxUnavailableError(f"tinker/MathTool-v0's python tool: {exc} Or offer the calculator alone: tools=['calculator'].") from exc
        available = {
            "python": Tool(name="python", fn=self._python_tool, schema=function_schema(python)),
            "calculator": Tool.from_function(calculator),
        }
        self.toolbox = ToolBox([available[name] for name in TOOL_NAMES if name in names], max_result_length=self.max_tool_output)
        self.tool_calls_used = 0
        self.turn = 0

    # ----- the tools ------------------------------------------------------------------------------
    def _python_tool(self, code: str) -> str:
        """The ``python`` tool with this env's limits."""
        return run_python(
            code, timeout=self.python_timeout, memory_mb=self.python_memory_mb, max_output=self.max_tool_output,
            python=self.python_executable, isolation=self.python_sandbox,
        ).to_text()

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The schemas of the offered tools."""
        return self.toolbox.schemas()

    def call_example(self) -> str:
        """A tool call in the format the env reads, of a tool it offers (the calculator where it is offered)."""
        return _CALL_EXAMPLES["calculator" if "calculator" in self.toolbox.names else self.toolbox.names[0]]

    def get_system_prompt(self) -> str:
        """Instructions, the tool-call format and the offered tools."""
        lines = [
            "You solve math word problems and may use tools before answering. To call a tool, write",
            self.call_example(),
            "(one block per call; several calls in one message are fine). Results come back in <tool_response> blocks. Tools:",
        ]
        for schema in self.toolbox.schemas():
            fn = schema["function"]
            lines.append(f"- {fn['name']}({', '.join(fn['parameters']['properties'])}): {fn['description']}")
        lines.append(
            f"You may make at most {self.max_tool_calls} tool calls. When you are done, reply WITHOUT tool calls "
            "and end with the final answer as \\boxed{...}, e.g. \\boxed{42} or \\boxed{3/4}."
        )
        return "\n".join(lines)

    # ----- episode --------------------------------------------------------------------------------
    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.tool_calls_used = 0
        self.turn = 0
        observation, info = super()._reset(options)
        tools = " and ".join(self.toolbox.names)
        observation = (
            f"{self.problem.question}\n\n"  # type: ignore[union-attr]
            f"You may call {tools} (up to {self.max_tool_calls} calls) before answering. "
            "Give your final answer as \\boxed{...} in a message without tool calls."
        )
        return observation, info

    def _step(self, action: str) -> StepResult:
        assert self.problem is not None
        self.turn += 1
        parsed = parse_tool_calls(action)
        wants_tools = bool(parsed.calls or parsed.errors)
        out_of_calls = self.tool_calls_used >= self.max_tool_calls
        if not wants_tools:
            return self._final(action, note="")
        if out_of_calls:
            return self._final(action, note="No tool calls were left, so this message was graded as the final answer.")
        if self.turn >= self.max_turns:
            return self._final(action, note="That was the last turn, so this message was graded as the final answer.")
        return self._tool_turn(parsed)

    def _final(self, action: str, note: str) -> StepResult:
        assert self.problem is not None
        result = grade(action, self.problem.answer)
        observation = feedback(result, self.problem)
        if note:
            observation = f"{note}\n{observation}"
        info = grade_info(result, self.problem)
        info.update(tool_calls_used=self.tool_calls_used, turn=self.turn)
        return observation, self.score(result), True, False, info

    def _tool_turn(self, parsed: ParsedToolCalls) -> StepResult:
        observation, info, self.tool_calls_used = tool_turn(
            self.toolbox, parsed, used=self.tool_calls_used, max_calls=self.max_tool_calls, turn=self.turn, max_turns=self.max_turns,
            limit=self.max_observation_length,
        )
        return observation, 0.0, False, False, info

    def invalid_action_hint(self) -> str:
        """What a valid message looks like."""
        return f"Call a tool with {self.call_example()}, or reply with your final answer as \\boxed{{...}}."


def tool_turn(toolbox: ToolBox, parsed: ParsedToolCalls, *, used: int, max_calls: int, turn: int, max_turns: int,
              limit: int) -> tuple[str, dict[str, Any], int]:
    """A turn of tool calls (the tool envs of this package and of others, e.g. ``tinker/GeometryTool-v0``): each call run
    while the budget of ``max_calls`` lasts (``used`` so far), its result and each parse error in a ``<tool_response>``
    block, then what is left; the text cut to ``limit`` characters. ``(observation text, info, calls used now)``."""
    blocks, results, calls = [], [], []
    for call in parsed.calls:
        calls.append({"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False, default=str)})
        if used >= max_calls:
            content = f"Error: tool call limit ({max_calls}) reached; this call was not run."
        else:
            used += 1
            content = printable(toolbox.call(call))
        results.append({"name": call.name, "content": content})
        blocks.append(f"<tool_response>\n{content}\n</tool_response>")
    errors = [printable(error) for error in parsed.errors]
    blocks.extend(f"<tool_response>\nError: {error}\n</tool_response>" for error in errors)
    left = max_calls - used
    if left <= 0:
        blocks.append("No tool calls are left: your next message is graded as the final answer; end it with \\boxed{...}.")
    elif turn + 1 >= max_turns:
        blocks.append("This is your last turn: your next message is graded as the final answer; end it with \\boxed{...}.")
    else:
        blocks.append(f"Tool calls left: {left}. Reply without tool calls to give your final answer as \\boxed{{...}}.")
    text = "\n".join(blocks)
    if len(text) > limit:
        note = "\n... [tool output cut to fit the observation]"
        text = text[: limit - len(note)] + note
    info = {"tool_calls": calls, "tool_results": results, "tool_errors": errors, "tool_calls_used": used, "tool_calls_left": left, "turn": turn}
    return text, info, used


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (fractions stay fractions).

    Args:
        expression: Numbers with + - * / // % ** (or ^) and parentheses, plus sqrt, abs, round, floor,
            ceil, min, max, log, exp, sin, cos, tan, factorial, gcd, lcm, comb, perm, pi and e;
            for example "(3/4 + 1/6) * 12". No variables.
    """
    return calculate(expression)


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: A Python program. The value of a final bare expression is printed too. No network, no
            input(), limited time and memory; each call starts a fresh process (no shared state).
    """
    return run_python(code).to_text()

