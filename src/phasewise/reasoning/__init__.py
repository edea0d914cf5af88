"""Reasoning ("thinking") in a model's output: the parser that splits `<think>…</think>` off the answer
as the text streams, and the choice of a parser from a chat template. Plain Python."""

from phasewise.reasoning.parser import (PARSERS, ParserName, ReasoningParser, choose_parser,
                                       prompt_opens_thinking)

__all__ = ["PARSERS", "ParserName", "ReasoningParser", "choose_parser", "prompt_opens_thinking"]
