"""What `phasewise serve --ray` costs and buys (issue 53's targets), in one run on this machine:

    .venv/bin/python benchmarks/ray_serve.py [--rounds 4] [--json docs/results/ray_serve.json]

1. **The Serve path on one replica against `phasewise serve`**, both up at once and measured alternately
   (rounds in A-B, B-A order), each with --threads kernel threads (default 1: on a 2-core machine the
   other core runs the client, Serve's proxy and the relay, or the plain server's HTTP loop): TTFT p50 of
   streamed completions sent one at a time (random 128-token prompts, new each round, 8 output tokens;
   target: at most 15 ms more), and served output tokens/s at 8 streams (16 requests of 64 prompt and 64
   output tokens; target >= 90%), streamed (the target's) and unstreamed (the same requests as JSON: what
   the transport costs per streamed token, not per request).
2. **Prefix-aware routing**: the same chats (--prefixes long system prompts of ~600 words, each asked
   --asks times, interleaved, one at a time, max_tokens 1) against 2 replicas under PrefixAffinityRouter,
   1 replica, and 2 replicas under Serve's default router (power of two choices: random among idle
   replicas); the share of prompt tokens served from cache (usage.prompt_tokens_details.cached_tokens).
   Target: 2 prefix-routed replicas >= 90% of one replica's share.
3. **A replica killed under load** (2 replicas; 32 streamed chats, 8 at a time, 48 output tokens; one
   replica `ray.kill`ed --kill-after s in): every request must end with tokens or an error (an error
   event, an HTTP error), none hang (120 s); then 8 requests after the load must all complete.

Ray runs in this process (a local head of max(2, --threads) CPUs, Serve's ingress on a free port: its
HAProxy straight to the replicas, as `serve --ray` starts it, or with `--ray-ingress proxy` Serve's Python
proxy and the relay), the plain server as a subprocess (benchmarks/serving.py's `running`); the load is
this process's httpx client. Parts 2 and 3 run replicas of one CPU each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from run_record import run_record                                           # noqa: E402
from serving import free_port, running                                      # noqa: E402

from phasewise.lab.load_gen import WORDS, random_prompts                    # noqa: E402

APP = "phasewise"
TIMEOUT_S = 120.0


@dataclass
class Outcome:
    start: float
    end: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    error: str = ""
    done: bool = False               # [DONE] (or a whole JSON body) without an error

    @property
    def lost(self) -> bool:
        return not self.done and not self.error


async def stream(client: httpx.AsyncClient, path: str, body: dict) -> Outcome:
    """One streamed request: its TTFT (first content), tokens (usage), and how it ended."""
    out = Outcome(time.perf_counter())
    try:
        async with client.stream("POST", path, json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = not out.error
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"].get("code") or event["error"].get("message"))[:80]
                for c in event.get("choices") or ():
                    if (c.get("text") or (c.get("delta") or {}).get("content")) and out.ttft is None:
                        out.ttft = time.perf_counter() - out.start
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as e:
        out.error = type(e).__name__
    finally:
        out.end = time.perf_counter()
    return out


async def ttft_ms(url: str, seed: int, n: int) -> list[float]:
    prompts = random_prompts(n, 128, 8, seed=seed)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        got = [await stream(client, "/v1/completions", {"model": "m", "prompt": p.prompt, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True}) for p in prompts]
    bad = [o.error for o in got if not o.done]
    if bad:
        raise RuntimeError(f"{url}: {len(bad)} of {n} TTFT requests failed: {bad[:3]}")
    return [o.ttft * 1e3 for o in got]


async def whole(client: httpx.AsyncClient, path: str, body: dict) -> Outcome:
    """One unstreamed request: its tokens (usage)."""
    out = Outcome(time.perf_counter())
    try:
        r = await client.post(path, json=body)
        out.error = "" if r.status_code == 200 else f"HTTP {r.status_code}"
        out.tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        out.done = not out.error
    except (httpx.HTTPError, ValueError) as e:
        out.error = type(e).__name__
    out.end = time.perf_counter()
    return out


async def served_tps(url: str, seed: int, streamed: bool = True, n: int = 16, streams: int = 8) -> float:
    prompts = random_prompts(n, 64, 64, seed=seed)
    limit = asyncio.Semaphore(streams)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=streams)) as c:
        async def one(p) -> Outcome:
            async with limit:
                return await (stream if streamed else whole)(
                    c, "/v1/completions", {"model": "m", "prompt": p.prompt, "max_tokens": 64, "temperature": 0,
                                           "ignore_eos": True})
        started = time.perf_counter()
        got = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
    if any(not o.done for o in got):
        raise RuntimeError(f"{url}: throughput requests failed: {[o.error for o in got if not o.done][:3]}")
    return sum(o.tokens for o in got) / wall


def deploy(options: dict, router: type | str | None = None) -> None:
    """The application of serve's flags `options` (replacing any), routed by `router` (default: ours)."""
    from ray import serve

    from phasewise.deploy.options import app_options
    from phasewise.deploy.ray import application

    o = app_options({"served-model-name": "m", **options})
    serve.delete(APP)                        # the previous one first: its replicas' CPUs are the new ones'
    serve.run(application(o) if router is None else application(o, router), name=APP, route_prefix="/")


def part_overhead(url: str, threads: int, rounds: int, per_round: int) -> dict:
    cmd = [sys.executable, "-m", "phasewise.cli", "serve", "--port", "{port}", "--no-access-log", "--threads",
           str(threads), "--kv-cache-memory", "0.5", "--served-model-name", "m"]
    deploy({"num-cpus-per-replica": threads, "kv-cache-memory": 0.5})
    ttft: dict[str, list[float]] = {"serve": [], "ray": []}
    tps: dict[str, list[float]] = {"serve": [], "ray": []}
    unstreamed: dict[str, list[float]] = {"serve": [], "ray": []}
    with running(cmd) as plain:
        urls = {"serve": plain, "ray": url}
        for name in urls:                                        # warm-up: first requests, kernels' first shapes
            asyncio.run(ttft_ms(urls[name], 999, 2))
            asyncio.run(served_tps(urls[name], 999, 8))
        for r in range(rounds):
            for name in (("serve", "ray") if r % 2 == 0 else ("ray", "serve")):
                ttft[name] += asyncio.run(ttft_ms(urls[name], 1000 + r, per_round))
                tps[name].append(asyncio.run(served_tps(urls[name], 2000 + r)))
                unstreamed[name].append(asyncio.run(served_tps(urls[name], 3000 + r, streamed=False)))
                print(f"  round {r}: {name:>5} TTFT p50 {statistics.median(ttft[name][-per_round:]):6.1f} ms, "
                      f"{tps[name][-1]:6.1f} tok/s at 8 streams ({unstreamed[name][-1]:6.1f} unstreamed)", flush=True)
    ratios = [b / a for a, b in zip(tps["serve"], tps["ray"])]
    diffs = [statistics.median(ttft["ray"][i:i + per_round]) - statistics.median(ttft["serve"][i:i + per_round])
             for i in range(0, len(ttft["ray"]), per_round)]
    return {"threads": threads, "rounds": rounds, "ttft_requests_per_round": per_round,
            "ttft_p50_ms": {k: statistics.median(v) for k, v in ttft.items()},
            "ttft_p50_extra_ms": statistics.median(ttft["ray"]) - statistics.median(ttft["serve"]),
            "ttft_p50_extra_ms_per_round": diffs,
            "tok_s_8_streams": tps, "tok_s_ratio": sum(tps["ray"]) / sum(tps["serve"]),
            "tok_s_ratio_per_round": ratios, "tok_s_8_unstreamed": unstreamed,
            "tok_s_unstreamed_ratio": sum(unstreamed["ray"]) / sum(unstreamed["serve"])}


def prefix_chats(prefixes: int, asks: int, words: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    systems = [f"System prompt {k}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for k in range(prefixes)]
    return [{"model": "m", "max_tokens": 1, "temperature": 0,
             "messages": [{"role": "system", "content": systems[k]},
                          {"role": "user", "content": f"Question {a} about topic {k}: " +
                           " ".join(rng.choice(WORDS) for _ in range(12))}]}
            for a in range(asks) for k in range(prefixes)]


def cached_share(url: str, chats: list[dict]) -> dict:
    cached = prompt = 0
    replicas: dict[int, set[str]] = {}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        for i, chat in enumerate(chats):
            r = client.post("/v1/chat/completions", json=chat)
            r.raise_for_status()
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            replicas.setdefault(hash(chat["messages"][0]["content"]), set()).add(r.headers.get("x-phasewise-replica"))
    return {"prompt_tokens": prompt, "cached_tokens": cached, "share": cached / prompt,
            "replicas_per_prefix": statistics.mean(len(v) for v in replicas.values())}


def part_routing(url: str, prefixes: int, asks: int) -> dict:
    chats = prefix_chats(prefixes, asks, 600)
    out = {}
    for name, replicas, router in (("one_replica", 1, None),
                                   ("random_2", 2, "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"),
                                   ("prefix_2", 2, None)):
        deploy({"num-replicas": replicas, "kv-cache-memory": 0.5}, router)
        out[name] = cached_share(url, chats)
        print(f"  {name:>11}: {out[name]['share']:.1%} of prompt tokens from cache "
              f"({out[name]['replicas_per_prefix']:.1f} replicas per prefix)", flush=True)
    out["prefix_2_over_one"] = out["prefix_2"]["share"] / out["one_replica"]["share"]
    out["random_2_over_one"] = out["random_2"]["share"] / out["one_replica"]["share"]
    return {"prefixes": prefixes, "asks": asks, "system_words": 600, **out}


async def _load_with_kill(url: str, n: int, streams: int, kill_after: float) -> tuple[list[Outcome], float, str]:
    import ray

    rng = random.Random(3)
    limit = asyncio.Semaphore(streams)
    killed: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=streams)) as c:
        async def one(i: int) -> Outcome:
            async with limit:
                words = " ".join(rng.choice(WORDS) for _ in range(30))
                chat = {"model": "m", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"{i}: {words}"}]}
                return await stream(c, "/v1/chat/completions", chat)

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.sleep(kill_after)
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == "serve" and "EngineReplica" in a["name"])
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        killed.append(time.perf_counter())
        got = await asyncio.gather(*tasks)
    return list(got), killed[0], names[0]


def part_kill(url: str, kill_after: float) -> dict:
    got, killed, victim = asyncio.run(_load_with_kill(url, 32, 8, kill_after))
    started_after = [o for o in got if o.start > killed]
    print(f"  killed {victim.split('#')[-1]} {kill_after:.0f} s in", flush=True)

    async def after() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as c:
            return [await stream(c, "/v1/chat/completions", {"model": "m", "max_tokens": 16, "temperature": 0,
                                                             "messages": [{"role": "user", "content": f"After {i}."}]})
                    for i in range(8)]
    later = asyncio.run(after())
    errors: dict[str, int] = {}
    for o in got:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {"requests": len(got), "completed": sum(o.done for o in got), "errors": errors,
            "lost": sum(o.lost for o in got),
            "errors_after_tokens": sum(bool(o.error) and o.ttft is not None for o in got),
            "started_after_kill": len(started_after),
            "started_after_kill_completed": sum(o.done for o in started_after),
            "longest_s": max(o.end - o.start for o in got),
            "after_load": len(later), "after_load_completed": sum(o.done for o in later)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="the plain server's threads and the replica's CPUs")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ttft-requests", type=int, default=8, help="TTFT requests per server per round")
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--asks", type=int, default=4, help="questions per system prompt")
    ap.add_argument("--kill-after", type=float, default=3.0)
    ap.add_argument("--parts", default="overhead,routing,kill")
    ap.add_argument("--ray-ingress", default="direct", choices=("direct", "proxy"))
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent.parent / "docs/results/ray_serve.json")
    args = ap.parse_args()
    if args.ray_ingress == "direct":         # Ray Serve reads its switches when imported and started
        from phasewise.deploy.options import DIRECT_INGRESS_ENV
        os.environ.update(DIRECT_INGRESS_ENV)
    import ray
    from ray import serve

    result = {**run_record("ray_serve", args.threads), "ray_ingress": args.ray_ingress}
    parts = args.parts.split(",")
    ray.init(address="local", num_cpus=max(2, args.threads), include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        if "overhead" in parts:
            print("1. the Serve path on one replica vs phasewise serve", flush=True)
            result["overhead"] = o = part_overhead(url, args.threads, args.rounds, args.ttft_requests)
            print(f"  TTFT p50 {o['ttft_p50_ms']['ray']:.1f} vs {o['ttft_p50_ms']['serve']:.1f} ms "
                  f"({o['ttft_p50_extra_ms']:+.1f} ms; per round {min(o['ttft_p50_extra_ms_per_round']):+.1f} .. "
                  f"{max(o['ttft_p50_extra_ms_per_round']):+.1f}); tok/s at 8 streams {o['tok_s_ratio']:.1%} "
                  f"(per round {min(o['tok_s_ratio_per_round']):.1%} .. {max(o['tok_s_ratio_per_round']):.1%}); "
                  f"unstreamed {o['tok_s_unstreamed_ratio']:.1%}", flush=True)
        if "routing" in parts or "kill" in parts:
            print("2. prefix-aware routing: share of prompt tokens from cache", flush=True)
            result["routing"] = r = part_routing(url, args.prefixes, args.asks)
            print(f"  prefix-routed 2 replicas / one replica: {r['prefix_2_over_one']:.1%}; "
                  f"random 2 / one: {r['random_2_over_one']:.1%}", flush=True)
        if "kill" in parts:
            print("3. a replica killed under load (2 replicas, prefix-routed)", flush=True)
            result["kill"] = k = part_kill(url, args.kill_after)
            print(f"  {k['requests']} requests: {k['completed']} completed, errors {k['errors']}, {k['lost']} lost; "
                  f"started after the kill: {k['started_after_kill_completed']}/{k['started_after_kill']} completed; "
                  f"after the load: {k['after_load_completed']}/{k['after_load']}", flush=True)
        result["duration_s"] = time.monotonic() - t0
        result["loadavg_after"] = os.getloadavg()[0]
    finally:
        serve.shutdown()
        ray.shutdown()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
