"""`phasewise serve --ray` on a local Ray cluster of two nodes (Ray's own `cluster_utils.Cluster`, 1 CPU each)
with two replicas of the default model, through the openai SDK: the same greedy outputs as a plain
`phasewise serve` at the same thread count, streamed and not; prompts sharing a prefix land on one replica;
a replica killed mid-stream ends that stream with an error, new requests reach the other replica and Serve
starts a new one; /metrics reports each replica and their sums. `make test-ray` installs Ray and runs these
(make test leaves them out). Every wait has a deadline; a failed start prints what Serve logged."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from live_server import MODEL, free_port, start_server, stop_server

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("ray.serve", reason="Ray is not installed (make test-ray)")
import ray  # noqa: E402
openai = pytest.importorskip("openai")

DEPLOY_TIMEOUT = 180.0
QUESTIONS = ["Name three colours.", "What is the capital of France?", "Write a haiku about rain."]
SYSTEMS = ["You are a patient teacher of geography. Answer in one short sentence, and never use lists. " * 3,
           "You are a poet who only writes about the sea and its weather, in plain and simple words. " * 3]


def _chat(question: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def test_a_model_that_does_not_load_fails_the_deployment_with_the_loaders_line():
    """First, before the module's cluster: `serve --ray` starts a Ray instance of its own."""
    done = subprocess.run([sys.executable, "-m", "phasewise.cli", "serve", "--ray", "--model", "/nonexistent.gguf",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=DEPLOY_TIMEOUT)
    assert done.returncode == 2, done.stderr[-5000:]
    assert done.stderr.strip().splitlines()[-1] == ("phasewise: error: model not found: /nonexistent.gguf "
                                                    "(give a .gguf file or a Hugging Face model folder)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    """A plain `phasewise serve` at one kernel thread (a replica's): each question's greedy answer."""
    server = start_server(tmp_path_factory.mktemp("plain"), "--threads", "1")
    try:
        client = server.client()
        return {q: client.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=24, temperature=0)
                .choices[0].message.content for q in QUESTIONS}
    finally:
        stop_server(server)


@contextlib.contextmanager
def serve_cluster() -> Iterator[tuple[str, object]]:
    """Two Ray nodes of 1 CPU and Serve's proxy on a free port, shut down after: (base URL, cluster)."""
    from ray import serve
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", c
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """serve_cluster() with two engine replicas: (base URL, cluster)."""
    from phasewise.deploy.ray import build_app

    with serve_cluster() as (url, c):
        _deploy(c, build_app({"num-replicas": 2, "kv-cache-memory": 0.25}))
        yield url, c


def _deploy(c, app) -> None:
    """`app` as the application (replacing the one there), within DEPLOY_TIMEOUT."""
    from ray import serve

    from phasewise.deploy.ray import APP_NAME

    failure: list[BaseException] = []

    def deploy() -> None:
        try:
            serve.delete(APP_NAME)
            serve.run(app, name=APP_NAME, route_prefix="/")
        except BaseException as e:                 # noqa: BLE001 (reported below)
            failure.append(e)

    started = threading.Thread(target=deploy, daemon=True)
    started.start()
    started.join(DEPLOY_TIMEOUT)
    if started.is_alive() or failure:
        pytest.fail(f"Serve did not deploy within {DEPLOY_TIMEOUT:.0f} s: {failure[:1]}\n{_logs(c)}")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _logs(c) -> str:
    """The tail of each Serve log and each non-empty worker error log of the head node's session."""
    logs = Path(c.head_node.get_session_dir_path()) / "logs"
    out = []
    for path in sorted([*logs.glob("serve/*.log"), *logs.glob("*.err")]):
        text = path.read_text(errors="replace").strip()
        if text:
            out.append(f"--- {path.name}\n" + "\n".join(text.splitlines()[-15:]))
    return "\n".join(out)[-12000:]


def test_replicas_answer_as_plain_serve_streamed_and_not(reference, cluster):
    client = _client(cluster[0])
    for q in QUESTIONS:
        whole = client.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=24, temperature=0)
        assert whole.choices[0].message.content == reference[q]
        stream = client.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=24, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference[q]


def test_prompts_sharing_a_prefix_land_on_one_replica(cluster):
    client = _client(cluster[0])
    served: dict[int, set[str]] = {0: set(), 1: set()}
    for question in QUESTIONS * 2:
        for i, system in enumerate(SYSTEMS):
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=_chat(question, system),
                                                                   max_tokens=4, temperature=0)
            served[i].add(raw.headers["x-phasewise-replica"])
            raw.parse()
    assert all(len(replicas) == 1 for replicas in served.values()), served


def test_metrics_are_each_replicas_and_their_sums(cluster):
    import re

    import httpx

    client, served = _client(cluster[0]), set()
    for i in range(40):                              # until both replicas have served a request
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=_chat("Hi.", f"Metrics probe {i}, a prefix of its own. " * 3), max_tokens=1)
        served.add(raw.headers["x-phasewise-replica"])
        if len(served) == 2:
            break
    text = httpx.get(f"{cluster[0]}/metrics", timeout=30).text
    prompt_tokens = r'^phasewise:prompt_tokens_total\{(replica="([^"]+)",)?model_name="[^"]+"\} (\S+)$'
    rows = [(m.group(2), float(m.group(3))) for m in re.finditer(prompt_tokens, text, re.M)]
    per_replica = {replica: value for replica, value in rows if replica}
    total = [value for replica, value in rows if not replica]
    assert len(per_replica) == 2 and all(v > 0 for v in per_replica.values()), text[-3000:]
    assert total == [sum(per_replica.values())], rows


def test_a_replica_killed_mid_stream_ends_its_stream_and_the_others_serve(cluster):
    from ray import serve

    client = _client(cluster[0])
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_chat("Tell me a very long story about a lighthouse."), max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    victim = raw.headers["x-phasewise-replica"]
    stream = iter(raw.parse())
    next(stream)
    outcome: list[object] = []

    def drain() -> None:
        try:
            for _ in stream:
                pass
            outcome.append("ended without an error")
        except (openai.APIError, Exception) as e:    # noqa: BLE001 (the error is what is checked)
            outcome.append(e)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    killed = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    reader.join(30)
    assert not reader.is_alive(), "the stream hung after its replica was killed"
    assert outcome and isinstance(outcome[0], Exception), outcome
    print(f"the stream ended {time.monotonic() - killed:.1f} s after the kill: {outcome[0]!r}")

    answered = None
    deadline = time.monotonic() + 30
    while answered is None and time.monotonic() < deadline:
        try:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=_chat(QUESTIONS[0]),
                                                                   max_tokens=4, temperature=0)
            answered = raw.headers["x-phasewise-replica"]
        except openai.APIError:
            time.sleep(0.5)
    assert answered is not None and answered != victim, "no replica answered within 30 s of the kill"
    print(f"a new request was answered {time.monotonic() - killed:.1f} s after the kill")

    seen = {victim, answered}                    # a third replica id: the one Serve started in the victim's place
    deadline = time.monotonic() + 120
    while len(seen) < 3 and time.monotonic() < deadline:
        system = f"Request {len(seen)}-{time.monotonic()}: no prefix in common with any other. " * 2
        try:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=_chat("Hi.", system),
                                                                   max_tokens=1, temperature=0)
            seen.add(raw.headers["x-phasewise-replica"])
        except openai.APIError:
            pass
        time.sleep(0.3)
    replicas = serve.status().applications["phasewise"].deployments["EngineReplica"].replica_states
    assert len(seen) == 3, f"Serve did not start a replica in place of the killed one within 120 s: {replicas}"
    print(f"a new replica answered {time.monotonic() - killed:.1f} s after the kill")


def test_build_app_takes_serves_flags_with_serves_defaults():
    from phasewise.cli import build_parser
    from phasewise.deploy.options import app_options, replica_parser

    serve = build_parser().parse_args(["serve"])
    replica = replica_parser().parse_args([])
    assert {k: getattr(serve, k) for k in vars(replica)} == vars(replica)
    options = app_options({"num-replicas": "2", "kv_cache_memory": 0.25, "no-packed-cache": True})
    engine = options.engine
    assert (options.ray.num_replicas, engine.cache.kv_cache_memory_gib, engine.packed_cache) == (2, 0.25, False)
    with pytest.raises(ValueError, match="unrecognized"):
        app_options({"no-such-flag": 1})
    with pytest.raises(ValueError, match="--num-replicas is a fixed count"):
        app_options({"num-replicas": 2, "min-replicas": 1, "max-replicas": 3})
    with pytest.raises(ValueError, match="--prefill-decode runs one pair"):
        app_options({"prefill-decode": True, "num-replicas": 2})
    with pytest.raises(ValueError, match="tensor-parallel replicas on CPUs only"):
        app_options({"tensor-parallel-size": 2, "device": "cuda"})
    assert app_options({"tensor-parallel-size": 2, "placement-strategy": "SPREAD"}).ray.placement_strategy == "SPREAD"


def test_make_test_ray_turns_on_the_switches_serve_ray_sets():
    import shlex

    from phasewise.deploy.options import DIRECT_INGRESS_ENV, HAPROXY_RETRY_ENV

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    lines = {x.split(" = ", 1)[0]: x.split(" = ", 1)[1] for x in makefile.splitlines() if x.startswith("RAY_")}
    switches, retries = ({k: v for k, v in (kv.split("=", 1) for kv in shlex.split(lines[name]))}
                         for name in ("RAY_DIRECT_INGRESS", "RAY_HAPROXY_RETRIES"))
    assert (switches, retries) == (DIRECT_INGRESS_ENV, HAPROXY_RETRY_ENV)
    assert "$(RAY_DIRECT_INGRESS) $(RAY_HAPROXY_RETRIES) $(BIN)/python -m pytest" in makefile


def test_serve_ray_turns_on_haproxy_and_its_retries_unless_told_otherwise(monkeypatch):
    import os

    from phasewise.deploy.options import DIRECT_INGRESS_ENV, HAPROXY_RETRY_ENV, RayOptions, start_direct_ingress

    for name in (*DIRECT_INGRESS_ENV, *HAPROXY_RETRY_ENV):
        monkeypatch.delenv(name, raising=False)
    start_direct_ingress(RayOptions(ingress="proxy"))
    assert not any(name in os.environ for name in (*DIRECT_INGRESS_ENV, *HAPROXY_RETRY_ENV))
    start_direct_ingress(RayOptions(ingress="auto"))
    assert {k: os.environ[k] for k in (*DIRECT_INGRESS_ENV, *HAPROXY_RETRY_ENV)} == {**DIRECT_INGRESS_ENV,
                                                                                    **HAPROXY_RETRY_ENV}
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure")          # the user's own policy stands
    start_direct_ingress(RayOptions(ingress="direct", address="auto"))
    assert os.environ["RAY_SERVE_HAPROXY_RETRY_ON"] == "conn-failure"


def test_serve_ray_without_ray_says_how_to_install_it():
    code = "import sys; sys.modules['ray'] = None; from phasewise.cli import main; sys.exit(main(['serve', '--ray']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'phasewise[ray]'" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_path):
    """A tiny random Qwen2 (4 query heads, 1 KV head) with the default model's tokenizer: a model that
    splits over 2 ranks (the default model's 9 query heads do not)."""
    from model_builders import build_hf, hf_config

    from phasewise.tokenization.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny-tp")
    tokenizer = Tokenizer.from_gguf(default_model_path)
    hf = build_hf(hf_config("qwen2", vocab_size=len(tokenizer.hf), num_key_value_heads=1, max_position_embeddings=256))
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.hf.save_pretrained(path)
    return path


def test_a_tensor_parallel_replica_across_the_two_nodes_answers_as_one_process(cluster, tiny_folder, tmp_path):
    """Late (it replaces the application): one replica of 2 ranks, one on each node (STRICT_SPREAD), at fp32
    gives one `phasewise serve` process's greedy tokens; a rank killed fails the replica's health check and
    Serve's new replica (new ranks) answers the same."""
    from ray import serve

    from phasewise.deploy.ray import APP_NAME, build_app

    url, c = cluster
    fp32 = {"model": str(tiny_folder), "served-model-name": "tiny", "dtype": "fp32", "kv-dtype": "model",
            "kv-cache-memory": 0.05}
    prompts = ["Once upon a time", "The capital of France is"]

    def answers(client: openai.OpenAI) -> list[list[str]]:
        out = []
        for p in prompts:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True})
            out.append(r.choices[0].logprobs.tokens)
        return out

    server = start_server(tmp_path, *[a for k, v in fp32.items() for a in (f"--{k}", str(v))], "--threads", "1")
    try:
        reference = answers(server.client())
    finally:
        stop_server(server)
    _deploy(c, build_app({**fp32, "tensor-parallel-size": 2, "num-cpus-per-replica": 2,
                          "placement-strategy": "STRICT_SPREAD"}))
    nodes = serve.get_deployment_handle("EngineReplica", APP_NAME).rank_nodes.remote().result(timeout_s=60)
    assert len(set(nodes)) == 2, nodes
    client = _client(url)
    assert answers(client) == reference

    replica = client.models.with_raw_response.list().headers["x-phasewise-replica"]
    ray.kill(ray.get_actor(f"{replica}#rank1", namespace="serve"))       # rank 1 lost: the replica is replaced
    deadline, now = time.monotonic() + 120, replica
    while now == replica and time.monotonic() < deadline:
        time.sleep(1)
        try:
            now = client.models.with_raw_response.list().headers["x-phasewise-replica"]
        except openai.APIError:
            pass
    assert now != replica, "Serve did not replace the replica that lost a rank within 120 s"
    assert answers(client) == reference


def test_a_prefill_decode_pair_across_the_two_nodes_answers_as_one_instance(reference, cluster):
    """Last too: `--prefill-decode`, the prefill replica on one node and the decode replica on the other (1 CPU
    each), the prompt's KV blocks crossing over the pair's KV link: the plain server's greedy answers,
    streamed and not, the decode side's prompt tokens mostly from the transferred blocks."""
    from ray import serve

    from phasewise.deploy.ray import APP_NAME, build_app

    url, c = cluster
    _deploy(c, build_app({"prefill-decode": True, "kv-cache-memory": 0.25}))
    nodes = [serve.get_deployment_handle(d, APP_NAME).rank_nodes.remote().result(timeout_s=60)[0]
             for d in ("PrefillReplica", "DecodeReplica")]
    assert nodes[0] != nodes[1], nodes
    client = _client(url)
    for q in QUESTIONS:
        whole = client.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=24, temperature=0)
        assert whole.choices[0].message.content == reference[q]
        assert whole.usage.prompt_tokens_details.cached_tokens >= 16, whole.usage
        stream = client.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=24, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference[q]
