"""/dashboard in a real headless browser (Debian's chromium driven by playwright), against a live
`phasewise serve` with an API key: the key rule, requests' bars appearing and finishing as the openai
client streams them, the KV gauge back at zero, and saved runs opened by dropping a file.

`make test-browser` installs chromium and playwright and runs these; where either is missing they
skip with the reason. Every wait is bounded, none is measured.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from live_server import KEY, MODEL, start_server, stop_server
from phasewise.core.handoffs import StepRecord
from phasewise.engine.step_event import StepEvent, StepExtras
from phasewise.core.request import RequestMetrics
from phasewise.lab.trace import chrome_trace

pytestmark = [pytest.mark.browser, pytest.mark.slow]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make test-browser)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (make test-browser)", allow_module_level=True)

# No background traffic: this machine's network is closed, and chromium would keep trying.
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[2]
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("dashboard"), "--api-key", KEY, "--max-num-seqs", "8")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, keyed):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
    page.goto(keyed.url + "/dashboard")
    yield page
    context.close()


def _connect(page) -> None:
    page.wait_for_selector("#keyform:not([hidden])", timeout=WAIT_MS)
    page.fill("#key", KEY)
    page.click("#keyform button")
    page.wait_for_function("document.getElementById('status').dataset.state === 'live'", timeout=WAIT_MS)


def _drop(page, name: str, text: str) -> None:
    """A real drop event carrying the file, as a user's drag from the desktop delivers it."""
    page.evaluate("""([name, text]) => {
        const dt = new DataTransfer();
        dt.items.add(new File([text], name, { type: "application/json" }));
        window.dispatchEvent(new DragEvent("drop", { dataTransfer: dt, bubbles: true }));
    }""", [name, text])


def test_the_page_needs_the_key_then_follows_requests_to_their_end(page, keyed, tmp_path):
    page.wait_for_selector("#keyform:not([hidden])", timeout=WAIT_MS)
    assert page.text_content("#status") == "API key needed"
    page.fill("#key", "wrong")
    page.click("#keyform button")
    page.wait_for_function("document.getElementById('keyerror').textContent.includes('refused')", timeout=WAIT_MS)
    _connect(page)
    assert page.input_value("#refresh") == "5"           # the default: few steps meet a frame (benchmarks.md)
    page.select_option("#refresh", "1")                  # reconnects at one snapshot a second
    page.wait_for_function("document.getElementById('status').dataset.state === 'live'", timeout=WAIT_MS)

    client = keyed.client(KEY)
    # One request held open until the page has drawn it running, then dropped (the client closes its
    # stream, the server aborts it): the page follows a running request whatever the machine's speed.
    drawn, held = threading.Event(), {}

    def hold() -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            held.setdefault("id", chunk.id)
            if drawn.is_set():
                break
        stream.close()

    holder = threading.Thread(target=hold)
    holder.start()
    page.wait_for_function(
        "() => window.phasewise.bars().some(b => ['queued', 'prefill', 'decode'].includes(b.state))",
        timeout=WAIT_MS)
    page.screenshot(path=str(tmp_path / "under-load.png"))
    running = [b["id"] for b in page.evaluate("window.phasewise.bars()") if b["state"] != "finished"]
    drawn.set()
    holder.join()
    assert running == [held["id"]], running

    finished: dict[str, str] = {}

    def one(i: int) -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me story number {i}."}],
            max_tokens=40 + 30 * i, stream=True)
        rid = None
        for chunk in stream:
            rid = chunk.id
            if chunk.choices and chunk.choices[0].finish_reason:
                finished[rid] = chunk.choices[0].finish_reason

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(finished) == 4
    page.wait_for_function(
        "ids => ids.every(id => window.phasewise.bars().some(b => b.id === id && b.state === 'finished'))",
        arg=list(finished), timeout=WAIT_MS)
    bars = {b["id"]: b for b in page.evaluate("window.phasewise.bars()")}
    assert {rid: bars[rid]["reason"] for rid in finished} == finished
    page.wait_for_function("document.querySelector('[data-card=kv] b').textContent === '0'", timeout=WAIT_MS)
    page.wait_for_function("document.querySelector('[data-card=running] b').textContent === '0'", timeout=WAIT_MS)
    rows = page.eval_on_selector("tr[data-metric=ttft_ms]", "tr => [...tr.cells].map(c => c.textContent)")
    assert int(rows[-1]) >= 4 and float(rows[1]) > 0          # samples, p50
    assert page.errors == []


def test_saved_runs_open_by_dropping_them(page):
    _connect(page)
    m = RequestMetrics(arrival=10.0, first_scheduled=10.5, first_token=11.0, token_times=[11.0, 11.1, 11.3],
                       prefill_chunks=[(10.5, 10.7, 8), (10.8, 11.0, 4)], preempted_at=[11.15], finished=11.3)
    steps = [StepEvent(StepRecord(start=10.5, duration_ms=200.0, num_prefill_tokens=8, num_decode_tokens=0,
                                  batch_size=1), StepExtras()),
             StepEvent(StepRecord(start=10.8, duration_ms=200.0, num_prefill_tokens=4, num_decode_tokens=2,
                                  batch_size=3), StepExtras(threads=1))]
    _drop(page, "trace.json", json.dumps(chrome_trace(steps, [("r1", m)])))
    page.wait_for_function("document.getElementById('status').textContent === 'viewing trace.json'", timeout=WAIT_MS)
    # the status changes at once, the page redraws on the next animation frame
    page.wait_for_function("window.phasewise.bars().map(b => b.id).join() === 'r1'", timeout=WAIT_MS)
    assert page.evaluate("window.phasewise.bars()") == [{"id": "r1", "state": "finished", "reason": None}]
    ttft = page.eval_on_selector("tr[data-metric=ttft_ms]", "tr => tr.cells[1].textContent")
    assert float(ttft) == pytest.approx(1000.0)                 # arrival 10.0 → first token 11.0
    caption = page.text_content("#steps-caption")
    assert "2 steps shown" in caption and "batch 3, 200.0 ms, 1 thread ·" in caption   # the last step's threads

    results = (ROOT / "docs/results/prompt-sweep/results.json").read_text()
    _drop(page, "results.json", results)
    page.wait_for_function("document.getElementById('status').textContent === 'viewing results.json'",
                           timeout=WAIT_MS)
    rows = len(json.loads(results)["rows"])
    page.wait_for_function(f"window.phasewise.bars().length === {rows}", timeout=WAIT_MS)
    assert all(b["id"] != "r1" for b in page.evaluate("window.phasewise.bars()"))

    _drop(page, "notes.json", '{"hello": 1}')
    page.wait_for_function("document.getElementById('status').textContent.includes('not a phasewise trace')",
                           timeout=WAIT_MS)
    page.click("#live")
    page.wait_for_function("document.getElementById('status').dataset.state === 'live'", timeout=WAIT_MS)
    assert page.errors == []


def test_replicas_of_a_ray_deployment_show_from_its_metrics(page, keyed):
    """A single server's page has no replicas panel; behind Ray Serve /metrics carries every replica's
    samples (replica_metrics.merge_metrics, here over this server's real text as two replicas), and the
    page shows a row for each."""
    import httpx

    from phasewise.deploy.replica_metrics import merge_metrics

    _connect(page)
    assert page.is_hidden("#replicas-panel")
    text = httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    ids = ["SERVE_REPLICA::phasewise#EngineReplica#aaaa1111", "SERVE_REPLICA::phasewise#EngineReplica#bbbb2222"]
    merged = merge_metrics({i: text for i in ids})
    page.route("**/metrics", lambda route: route.fulfill(status=200, body=merged,
                                                         headers={"content-type": "text/plain; version=0.0.4"}))
    page.evaluate("Replicas.poll()")
    page.wait_for_selector("#replicas-panel:not([hidden]) tr[data-replica=bbbb2222]", timeout=WAIT_MS)
    rows = page.eval_on_selector_all("#replicas tr[data-replica]", "trs => trs.map(tr => [...tr.cells].map(c => c.textContent))")
    assert [r[0] for r in rows] == ["aaaa1111", "bbbb2222"]
    assert all(r[1] == "0" for r in rows)                       # running: the server is idle
    assert page.text_content("#replicas-caption") == "2 replicas, from /metrics"
    assert page.errors == []


def test_a_mixture_of_experts_shows_its_routers_spread(page, keyed):
    """A dense model's page has no experts panel; a feed whose steps carry router choices (a snapshot
    of the server's own DashboardFeed, served in place of the live events) shows each layer's spread
    and how many experts a step read."""
    from dataclasses import replace

    from phasewise.core.handoffs import EngineStats
    from phasewise.server.dashboard_feed import DashboardFeed
    from phasewise.server.server_stats import ServerStats

    stats = ServerStats(engine=EngineStats(num_blocks=100, num_free_blocks=100))

    _connect(page)
    assert page.is_hidden("#experts-panel")
    feed = DashboardFeed(token_budget=64, max_num_seqs=8, num_blocks=100, clock=lambda: 11.0)
    step = StepRecord(start=10.0, duration_ms=30.0, num_prefill_tokens=0, num_decode_tokens=2, batch_size=2)
    for t, choices in ((10.0, [[2, 2, 0, 0], [0, 0, 4, 0]]), (10.5, [[4, 0, 0, 0], [1, 1, 1, 1]])):
        feed.on_step(StepEvent(replace(step, start=t), StepExtras(expert_choices=choices)), stats)
    snap = feed.snapshot(0, stats)
    body = f"event: hello\ndata: {json.dumps({'model': MODEL, 'version': 'test'})}\n\ndata: {json.dumps(snap)}\n\n"
    page.route("**/dashboard/events*", lambda route: route.fulfill(status=200, body=body,
                                                                   headers={"content-type": "text/event-stream"}))
    page.select_option("#refresh", "2")                        # the page reconnects: to the served events
    page.wait_for_selector("#experts-panel:not([hidden])", timeout=WAIT_MS)
    assert page.text_content("#experts-caption").startswith("2 steps in the last 5 s read 4 of 8 experts a step (at most 5)")
    assert page.errors == []
