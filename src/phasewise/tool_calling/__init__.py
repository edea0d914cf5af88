"""Tool calling: tools into the prompt (the model's own template, or a generic one), the grammar that
forces a call, and the parser that finds calls in the output as it streams. Plain Python."""

from phasewise.tool_calling.parser import ToolCall, ToolCallParser, ToolFormat
from phasewise.tool_calling.prompt import (call_grammar, check_tools, generic_messages, native_messages,
                                           supports_tools, tool_format)

__all__ = ["ToolCall", "ToolCallParser", "ToolFormat", "call_grammar", "check_tools", "generic_messages",
           "native_messages", "supports_tools", "tool_format"]
