"""What reading the thinking costs the server: the reasoning parser (reasoning/parser.py), alone and under
the reply parser with tools (server/reply_parser.py), fed a reply as the engine streams it.

    .venv/bin/python benchmarks/reasoning_parser.py [--tokens 4000] [--rounds 5] [--json FILE]

The reply is a long thinking block (prose with `<`, tags of other kinds and a `<tool_call>` inside it, which
stays reasoning), `</think>`, then an answer with one Hermes tool call, about --tokens tokens of the default
model's tokenizer. It is streamed in realistic chunks: each token's text (a decode step), and runs of 1-4
tokens (speculative decoding's accepted drafts), every chunk boundary where the engine would put it, tags
split across chunks included. Per token: the median over --rounds of the time to feed every chunk, less the
same loop feeding nothing (the harness). Target: at most 50 µs per token. One thread, no model loaded.
Beside it, the engine's side of thinking (structured/thinking_gate.py), per token of the same reply: a gate
that only tracks the block (no budget), and one with a budget, checked then advanced as the sampler's
lazy check does (`valid_prefix`, then `accept`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_record import run_record                                           # noqa: E402

from phasewise.core.request import RequestMetrics                           # noqa: E402
from phasewise.core.sampling_params import ThinkingBlock                    # noqa: E402
from phasewise.loading.loader import default_model_path                     # noqa: E402
from phasewise.structured import ThinkingGates                              # noqa: E402
from phasewise.reasoning import ReasoningParser                             # noqa: E402
from phasewise.server.reply_parser import ReplyParser                       # noqa: E402
from phasewise.tokenization.tokenizer import Tokenizer                      # noqa: E402
from phasewise.tool_calling import ToolCallParser                           # noqa: E402

TARGET_US = 50.0
PROSE = ("The user asks for the weather in Paris tomorrow. I should check whether 3 < 4 holds for the dates, "
         "and whether a <b>bold</b> claim or a <tool_call> written here would be read as a call: it must not. "
         "Let me think about the units, Celsius or Fahrenheit, and about what the forecast tool returns. ")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "day": "tomorrow"}}\n</tool_call>'
ANSWER = "I will look the forecast up for you.\n" + CALL


def reply_ids(tokenizer: Tokenizer, tokens: int) -> list[int]:
    """The reply's token ids."""
    body = tokenizer.encode(ANSWER, add_special_tokens=False)
    prose = tokenizer.encode(PROSE, add_special_tokens=False)
    thinking = (prose * (max(tokens - len(body), len(prose)) // len(prose) + 1))[:max(tokens - len(body) - 8, 1)]
    return tokenizer.encode("<think>\n", add_special_tokens=False) + thinking \
        + tokenizer.encode("\n</think>\n\n", add_special_tokens=False) + body


def reply(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The reply's tokens as text pieces (each token's bytes decoded in the stream's order)."""
    pieces, raw = [], b""
    for t in ids:                                  # what the detokenizer gives out step by step
        raw += tokenizer.token_bytes(t)
        text = raw.decode("utf-8", errors="ignore")
        if text:
            pieces.append(text)
            raw = raw[len(text.encode()):]
    return pieces


def chunked(pieces: list[str], most: int, seed: int = 0) -> list[str]:
    """Runs of 1..most pieces joined (most 1: one chunk a token)."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(pieces):
        n = rng.randint(1, most)
        out.append("".join(pieces[i:i + n]))
        i += n
    return out


def feed_time(make: Callable[[], Callable[[str, bool], object]], chunks: list[str], rounds: int) -> float:
    """Median seconds to feed every chunk to a fresh parser (the last one final)."""
    times = []
    for _ in range(rounds):
        feed = make()
        last = len(chunks) - 1
        start = time.perf_counter()
        for i, c in enumerate(chunks):
            feed(c, i == last)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parsers() -> dict[str, Callable[[], Callable[[str, bool], object]]]:
    def reasoning() -> Callable[[str, bool], object]:
        return ReasoningParser("qwen3", prompt_open=False).feed

    def with_tools() -> Callable[[str, bool], object]:
        parser = ReplyParser(ReasoningParser("qwen3", prompt_open=False),
                             ToolCallParser("hermes", frozenset({"get_weather"})))
        return lambda text, final: parser.feed(text, final)

    def tools_only() -> Callable[[str, bool], object]:
        parser = ReplyParser(None, ToolCallParser("hermes", frozenset({"get_weather"})))
        return lambda text, final: parser.feed(text, final)

    def nothing() -> Callable[[str, bool], object]:
        return lambda text, final: None

    return {"harness": nothing, "reasoning": reasoning, "reply_with_tools": with_tools, "tools_only": tools_only}


def gate_time(tokenizer: Tokenizer, ids: list[int], budget: int | None, rounds: int) -> float:
    """Median seconds for one gate to take the reply's tokens (with a budget: each checked first)."""
    gates, prompt = ThinkingGates(tokenizer, tokenizer.eos_token_ids), tokenizer.encode("assistant\n")
    times = []
    for _ in range(rounds):
        gate = gates.gate(ThinkingBlock(budget=budget), prompt, None, RequestMetrics(arrival=0.0))
        start = time.perf_counter()
        for t in ids:
            if gate.constrains:
                gate.valid_prefix([t])
            gate.accept(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(pieces: list[str]) -> None:
    """The parse is right before it is timed: the thinking apart, the call read from the answer only."""
    parser = ReplyParser(ReasoningParser("qwen3", prompt_open=False), ToolCallParser("hermes", frozenset({"get_weather"})))
    for i, c in enumerate(pieces):
        parser.feed(c, i == len(pieces) - 1)
    assert parser.reasoning.startswith("The user asks") and "<tool_call>" in parser.reasoning, parser.reasoning[:80]
    assert [c.name for c in parser.calls] == ["get_weather"], parser.calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000, help="tokens in the reply (default 4000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    tokenizer = Tokenizer.load(default_model_path())
    ids = reply_ids(tokenizer, args.tokens)
    pieces = reply(tokenizer, ids)
    check(pieces)
    results = []
    for most in (1, 4):
        chunks = chunked(pieces, most)
        timed = {name: feed_time(make, chunks, args.rounds) for name, make in parsers().items()}
        for name in ("reasoning", "reply_with_tools", "tools_only"):
            us = (timed[name] - timed["harness"]) / len(pieces) * 1e6
            results.append({"parser": name, "tokens_per_chunk": f"1-{most}" if most > 1 else "1", "chunks": len(chunks),
                            "tokens": len(pieces), "us_per_token": round(us, 3), "within_target": us <= TARGET_US})
    for name, budget in (("gate_tracking", None), ("gate_budget", len(ids))):
        us = gate_time(tokenizer, ids, budget, args.rounds) / len(ids) * 1e6
        results.append({"parser": name, "tokens_per_chunk": "1", "chunks": len(ids), "tokens": len(ids),
                        "us_per_token": round(us, 3), "within_target": us <= TARGET_US})
    for r in results:
        print(f"{r['parser']:>17}  {r['tokens_per_chunk']:>3} tokens a chunk: {r['us_per_token']:8.2f} µs per token "
              f"({'within' if r['within_target'] else 'OVER'} the {TARGET_US:.0f} µs target)")
    report = {**run_record("reasoning_parser", 1), "target_us_per_token": TARGET_US, "rows": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    else:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
