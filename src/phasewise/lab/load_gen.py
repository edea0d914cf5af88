"""Load for any OpenAI-compatible server: datasets, arrival times, and streaming requests timed per chunk.

Token counts come from the server's `usage` (asked for with stream_options.include_usage);
a server that sends none is counted by content chunks, and the summary says so.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from phasewise.json_types import JsonObject, JsonValue
from phasewise.lab.load_stats import RequestRecord

# ~1 token each in common BPE vocabularies: random text of about n tokens for the chat endpoint.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl "
         "guy").split()


@dataclass
class Prompt:
    prompt: str | list[int]          # text, or token ids (completions endpoint only)
    output_len: int


def random_prompts(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                   token_ids: bool = True, vocab: int = 32000) -> list[Prompt]:
    """Lengths uniform in [len·(1−r), len·(1+r)]; token ids in [100, vocab) or random words."""
    rng = random.Random(seed)

    def length(x: int) -> int:
        return max(1, rng.randint(int(x * (1 - range_ratio)), int(x * (1 + range_ratio))))

    out = []
    for _ in range(n):
        k = length(input_len)
        body = [rng.randrange(100, vocab) for _ in range(k)] if token_ids else \
            " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(Prompt(body, length(output_len)))
    return out


def shared_prefix_prompts(num_prefixes: int, per_prefix: int, prefix_len: int, suffix_len: int,
                          output_len: int, seed: int = 0, token_ids: bool = True,
                          vocab: int = 32000) -> list[Prompt]:
    """num_prefixes × per_prefix prompts: each a shared prefix plus its own suffix, in shuffled order."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(k)]

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)) + " "

    prompts: list[str | list[int]]               # drawn in one order either way: prefixes, then suffixes
    if token_ids:
        id_prefixes = [ids(prefix_len) for _ in range(num_prefixes)]
        prompts = [p + ids(suffix_len) for p in id_prefixes for _ in range(per_prefix)]
    else:
        text_prefixes = [text(prefix_len) for _ in range(num_prefixes)]
        prompts = [p + text(suffix_len) for p in text_prefixes for _ in range(per_prefix)]
    out = [Prompt(p, output_len) for p in prompts]
    rng.shuffle(out)
    return out


def file_prompts(path: str | Path, n: int, output_len: int) -> list[Prompt]:
    """Paragraphs (blank-line separated) of a text file, cycled to n prompts."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not paragraphs:
        raise ValueError(f"{path} holds no text")
    return [Prompt(paragraphs[i % len(paragraphs)], output_len) for i in range(n)]


def intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Gaps before each of n requests: 0 at an infinite rate, else gamma(shape=burstiness, mean 1/rate)
    (burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular)."""
    rng = random.Random(seed)
    for _ in range(n):
        yield 0.0 if rate == float("inf") else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


@dataclass(kw_only=True)
class Target:
    base_url: str                    # up to and including /v1
    model: str
    endpoint: str = "completions"    # completions | chat
    api_key: str | None = None
    ignore_eos: bool = True
    timeout: float = 600.0

    def body(self, p: Prompt) -> JsonObject:
        body: JsonObject = {"model": self.model, "max_tokens": p.output_len, "stream": True,
                            "temperature": 0.0, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": p.prompt if isinstance(p.prompt, str)
                                 else " ".join(map(str, p.prompt))}]
        else:
            body["prompt"] = p.prompt if isinstance(p.prompt, str) else list(p.prompt)
        return body

    @property
    def url(self) -> str:
        return f"{self.base_url}/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _content(event: Mapping[str, JsonValue], chat: bool) -> str:
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    part = choices[0].get("delta") if chat else choices[0]
    text = part.get("content" if chat else "text") if isinstance(part, dict) else None
    return text if isinstance(text, str) else ""


async def send(client: httpx.AsyncClient, target: Target, p: Prompt) -> RequestRecord:
    """One streamed request, timed per content chunk."""
    rec = RequestRecord(start=time.perf_counter())
    chunks = 0
    try:
        async with client.stream("POST", target.url, json=target.body(p), headers=target.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                rec.error = f"HTTP {resp.status_code}: {str(body)[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if _content(event, target.endpoint == "chat"):
                    rec.chunk_times.append(time.perf_counter())
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details")
                    cached = details.get("cached_tokens") if isinstance(details, dict) else None
                    rec.cached_tokens = cached if isinstance(cached, int) else 0
                    rec.usage_reported = True
        if not rec.usage_reported:
            rec.output_tokens = chunks
        rec.ok = True
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.end = time.perf_counter()
    return rec


async def run(target: Target, prompts: list[Prompt], rate: float = float("inf"), burstiness: float = 1.0,
              max_concurrency: int | None = None, seed: int = 0,
              on_done: Callable[[RequestRecord], None] = lambda r: None) -> tuple[list[RequestRecord], float]:
    """Send every prompt on its arrival schedule (and under the concurrency cap): (records, duration s)."""
    limit = asyncio.Semaphore(max_concurrency or len(prompts) or 1)
    connections = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1,
                               max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=target.timeout, limits=connections) as client:
        async def one(p: Prompt) -> RequestRecord:
            async with limit:
                rec = await send(client, target, p)
            on_done(rec)
            return rec

        started = time.perf_counter()
        tasks = []
        for p, gap in zip(prompts, intervals(len(prompts), rate, burstiness, seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(p)))
        records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - started


def first_model(base_url: str, api_key: str | None = None) -> str:
    """The id of the first model the server lists (GET /v1/models); ValueError when unreachable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/models", headers=headers, timeout=10)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except httpx.HTTPStatusError as e:
        raise ValueError(f"{base_url}/models answered HTTP {e.response.status_code}") from None
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}: {e}") from None
    except (KeyError, IndexError, ValueError):
        raise ValueError(f"{base_url}/models lists no model") from None
