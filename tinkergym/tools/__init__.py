"""Tool calling for text environments: a tool box, tool schemas from typed functions, and a tolerant tool-call parser.

:mod:`~tinkergym.tools.toolbox` holds the tools and reads the calls out of a model's message;
:mod:`~tinkergym.tools.schemas` turns a typed Python function into the schema chat templates take. The code a tool
runs for a model goes through :mod:`tinkergym.sandbox`. Standard library only.
"""

from tinkergym.tools.schemas import function_schema
from tinkergym.tools.toolbox import EXPECTED_FORM, MAX_JSON_DEPTH, ParsedToolCalls, Tool, ToolBox, ToolCall, parse_tool_calls

__all__ = [
    "EXPECTED_FORM",
    "MAX_JSON_DEPTH",
    "ParsedToolCalls",
    "Tool",
    "ToolBox",
    "ToolCall",
    "function_schema",
    "parse_tool_calls",
]
