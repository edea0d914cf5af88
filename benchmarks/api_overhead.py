"""What the agents' APIs cost over chat completions: time to first token of the same request through
/v1/chat/completions, /v1/responses and /v1/messages, streamed, against one `phasewise serve`.

    .venv/bin/python benchmarks/api_overhead.py [--model M] [--rounds 40] [--max-tokens 8] [--json FILE]

Each round sends the same conversation (a system prompt, a question, greedy, --max-tokens) through the
three routes in a rotating order, one request at a time, and times the first text delta of each as
the client sees it (the official SDKs' raw SSE, read with httpx). The prefix cache holds the prompt
after the first round, so the engine's work is the same every time and what differs is each API's
translation and event rendering. Medians and ranges of the differences to chat, taken round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from run_record import run_record                                           # noqa: E402
from serving import running                                                 # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"


def bodies(model: str, max_tokens: int) -> dict[str, tuple[str, dict]]:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return {
        "chat": ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": max_tokens,
                                          "temperature": 0, "stream": True}),
        "responses": ("/v1/responses", {"model": model, "instructions": SYSTEM, "input": QUESTION, "store": False,
                                        "max_output_tokens": max_tokens, "temperature": 0, "stream": True}),
        "messages": ("/v1/messages", {"model": model, "system": SYSTEM, "max_tokens": max_tokens, "temperature": 0,
                                      "messages": [{"role": "user", "content": QUESTION}], "stream": True}),
    }


def first_text_ms(client: httpx.Client, path: str, body: dict) -> float:
    """Milliseconds from sending to the first event that carries text."""
    start = time.perf_counter()
    with client.stream("POST", path, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            text = (event.get("choices") or [{}])[0].get("delta", {}).get("content") \
                or (event.get("delta") if event.get("type") == "response.output_text.delta" else None) \
                or (event.get("delta", {}).get("text") if event.get("type") == "content_block_delta" else None)
            if text:
                return (time.perf_counter() - start) * 1e3
    raise RuntimeError(f"{path}: no text came back")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "phasewise.cli", "serve", "--port", "{port}", "--no-access-log",
           "--served-model-name", "m", *(["--model", args.model] if args.model else [])]
    routes = bodies("m", args.max_tokens)
    names = list(routes)
    ttft: dict[str, list[float]] = {n: [] for n in names}
    with running(cmd) as url, httpx.Client(base_url=url, timeout=120) as client:
        for n in names:                                    # warm-up: the prefix cache, each route's first call
            first_text_ms(client, *routes[n])
        for r in range(args.rounds):
            for n in names[r % 3:] + names[:r % 3]:
                ttft[n].append(first_text_ms(client, *routes[n]))
    result = {**run_record("api_overhead", 0), "rounds": args.rounds, "ttft_ms": {}}
    print(f"{'route':>10} {'TTFT p50':>9} | {'minus chat, p50':>15} {'(range)':>18}")
    for n in names:
        diffs = [a - b for a, b in zip(ttft[n], ttft["chat"])]
        p50, lo, hi = statistics.median(diffs), min(diffs), max(diffs)
        result["ttft_ms"][n] = {"p50": statistics.median(ttft[n]), "minus_chat_p50": p50, "minus_chat_min": lo,
                                "minus_chat_max": hi}
        print(f"{n:>10} {statistics.median(ttft[n]):8.2f}ms | {p50:+14.2f}ms ({lo:+7.2f} .. {hi:+7.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
