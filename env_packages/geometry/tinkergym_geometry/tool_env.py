r"""``tinker/GeometryTool-v0``: the drawn geometry questions with a ``python`` and a ``calculator`` tool, over several turns."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from tinkergym.errors import ConfigError, SandboxUnavailableError
from tinkergym.sandbox import ISOLATIONS, check_sandbox, run_python
from tinkergym.tools import ParsedToolCalls, Tool, ToolBox, function_schema, parse_tool_calls

from tinkergym_math.tool_env import calculator, python, tool_turn

from tinkergym_geometry.env import KINDS, GeometryEnv
from tinkergym_geometry.visual import VisualStepResult

TOOL_NAMES = ("python", "calculator")
_CALL_EXAMPLE = '<tool_call>{"name": "calculator", "arguments": {"expression": "sqrt(7^2 + 9^2)"}}</tool_call>'


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: choose an integer from {low} to {high}.")
    return value


class GeometryToolEnv(GeometryEnv):
    r"""Multi-turn geometry questions about a drawn figure, with tools before the final answer.

    Tools, as ``tinker/MathTool-v0`` offers them (schemas in ``info["tools"]``): ``calculator(expression)``
    evaluates arithmetic exactly (``sqrt``, ``pi``, ``sin`` in radians...); ``python(code)`` runs code in
    :mod:`tinkergym.sandbox` (bubblewrap by default) and returns what it printed.

    Observation (:class:`~tinkergym.spaces.TextWithImages`): on reset, the figure and the question as in
    ``tinker/Geometry-v0`` plus the tools and the call budget; after tool calls, text only: one
    ``<tool_response>\n...\n</tool_response>`` block per call, then the calls and turns left; after the
    final answer, the feedback of ``tinker/Geometry-v0``.
    Action: a message; ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks call tools, and a
    message without calls is the final answer, graded as in ``tinker/Geometry-v0``.
    Reward: 0 on tool turns; on the final answer 1 if correct, else 0. A non-text or over-long action
    ends the episode with 0. Termination: when the final answer is graded; once the calls are used up,
    or on the ``max_turns``-th message, the message is graded as the final answer. Never truncated.

    ``info`` on reset: as ``tinker/Geometry-v0`` plus ``tools``. On tool turns: ``tool_calls``,
    ``tool_results``, ``tool_errors``, ``tool_calls_used``, ``tool_calls_left``, ``turn``. On the final
    answer: as ``tinker/Geometry-v0`` plus ``tool_calls_used`` and ``turn``.

    Args:
        kinds, render_mode: as for ``tinker/Geometry-v0``.
        max_tool_calls: Tool calls run per episode (default 4; 0 to 50).
        max_turns: Messages per episode, the final answer included (default 6; 1 to 50).
        tools: A subset of ``("python", "calculator")`` (default both).
        python_timeout: Seconds per ``python`` call (default 5; up to 60).
        python_sandbox: ``"bubblewrap"`` (default; the env refuses to be made where it cannot run) or
            ``"rlimits"`` (a weaker guard that is NOT a security boundary).
    """

    metadata = {**GeometryEnv.metadata, "tinkergym": {**GeometryEnv.metadata["tinkergym"], "turns": "multi"}}

    def __init__(
        self,
        kinds: Any = KINDS,
        max_tool_calls: int = 4,
        max_turns: int = 6,
        tools: Sequence[str] = TOOL_NAMES,
        python_timeout: float = 5.0,
        python_sandbox: str = "bubblewrap",
        render_mode: str | None = None,
    ) -> None:
        super().__init__(kinds=kinds, render_mode=render_mode)
        self.max_tool_calls = _check_int("max_tool_calls", max_tool_calls, 0, 50)
        self.max_turns = _check_int("max_turns", max_turns, 1, 50)
        if isinstance(python_timeout, bool) or not isinstance(python_timeout, (int, float)) or not 0 < python_timeout <= 60:
            raise ConfigError(f"python_timeout={python_timeout!r}: choose a number of seconds above 0 and at most 60.")
        self.python_timeout = float(python_timeout)
        names = [tools] if isinstance(tools, str) else list(tools) if isinstance(tools, (list, tuple)) else None
        if not names or any(name not in TOOL_NAMES for name in names) or len(set(names)) != len(names):
            raise ConfigError(f"tools={tools!r}: choose one or both of {list(TOOL_NAMES)}.")
        if python_sandbox not in ISOLATIONS:
            raise ConfigError(f"python_sandbox={python_sandbox!r}: choose 'bubblewrap' (the default) or 'rlimits' (weaker, not a security boundary).")
        self.python_sandbox, self.python_executable = python_sandbox, None
        if "python" in names:  # fail once, here, rather than in every call of a training run
            try:
                self.python_executable = check_sandbox(python_sandbox, None)
            except SandboxUnavailableError as exc:
                raise SandboxUnavailableError(f"tinker/GeometryTool-v0's python tool: {exc} Or offer the calculator alone: tools=['calculator'].") from exc
        available = {"python": Tool(name="python", fn=self._python_tool, schema=function_schema(python)), "calculator": Tool.from_function(calculator)}
        self.toolbox = ToolBox([available[n] for n in TOOL_NAMES if n in names], max_result_length=2_000)
        self.tool_calls_used = 0
        self.turn = 0

    def _python_tool(self, code: str) -> str:
        """The ``python`` tool with this env's limits."""
        return run_python(code, timeout=self.python_timeout, max_output=2_000, python=self.python_executable, isolation=self.python_sandbox).to_text()

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The schemas of the offered tools."""
        return self.toolbox.schemas()

    def get_system_prompt(self) -> str:
        """Instructions, the tool-call format and the offered tools."""
        lines = [super().get_system_prompt(), "You may use tools before answering. To call a tool, write", _CALL_EXAMPLE, "Results come back in <tool_response> blocks. Tools:"]
        for schema in self.toolbox.schemas():
            fn = schema["function"]
            lines.append(f"- {fn['name']}({', '.join(fn['parameters']['properties'])}): {fn['description']}")
        lines.append(f"You may make at most {self.max_tool_calls} tool calls. When you are done, reply WITHOUT tool calls and end with \\boxed{{...}}.")
        return "\n".join(lines)

    def _reset(self, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[override]
        self.tool_calls_used = 0
        self.turn = 0
        return super()._reset(options)

    def pose(self) -> str:
        """The question, the tools and the call budget."""
        assert self.problem is not None
        tools = " and ".join(self.toolbox.names)
        return (
            f"{self.problem.question}\n\nYou may call {tools} (up to {self.max_tool_calls} calls) before answering. "
            "Give your final answer as \\boxed{...} in a message without tool calls."
        )

    def _step(self, action: str) -> VisualStepResult:  # type: ignore[override]
        self.turn += 1
        parsed = parse_tool_calls(action)
        if not (parsed.calls or parsed.errors):
            return self._graded(action, "")
        if self.tool_calls_used >= self.max_tool_calls:
            return self._graded(action, "No tool calls were left, so this message was graded as the final answer.")
        if self.turn >= self.max_turns:
            return self._graded(action, "That was the last turn, so this message was graded as the final answer.")
        return self._tool_turn(parsed)

    def _graded(self, action: str, note: str) -> VisualStepResult:
        observation, reward, terminated, truncated, info = self._final(action, note)
        info.update(tool_calls_used=self.tool_calls_used, turn=self.turn)
        return observation, reward, terminated, truncated, info

    def _tool_turn(self, parsed: ParsedToolCalls) -> VisualStepResult:
        text, info, self.tool_calls_used = tool_turn(
            self.toolbox, parsed, used=self.tool_calls_used, max_calls=self.max_tool_calls, turn=self.turn, max_turns=self.max_turns,
            limit=self.max_observation_length,
        )
        return {"text": text, "images": ()}, 0.0, False, False, info

    def invalid_action_hint(self) -> str:
        """What a valid message looks like."""
        return f"Call a tool with {_CALL_EXAMPLE}, or reply with your final answer as \\boxed{{...}}."
