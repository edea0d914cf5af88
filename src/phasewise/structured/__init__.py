"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) compiled for one tokenizer by
llguidance, and the per-request matchers whose token masks the sampler applies. No torch here."""

from phasewise.structured.grammar_compiler import GrammarCompiler
from phasewise.structured.grammar_matcher import GrammarMatcher, draft_bitmask, grammar_bitmask
from phasewise.structured.step_masks import StepMasks
from phasewise.structured.thinking_gate import ThinkingGate, ThinkingGates

__all__ = ["GrammarCompiler", "GrammarMatcher", "StepMasks", "ThinkingGate", "ThinkingGates", "draft_bitmask",
           "grammar_bitmask"]
