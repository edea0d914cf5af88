"""The kernels' thread count adapts to the CPUs other programs leave free (runner/thread_governor.py),
and nothing a request gets depends on that count."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from phasewise.runner.thread_governor import WINDOW_S, CpuReader, CpuTimes, ThreadGovernor, usable_cpus


class Machine:
    """A fake /proc: each window, other programs keep `others` CPUs busy and we `own` CPUs."""

    def __init__(self) -> None:
        self.now = CpuTimes(0.0, 0.0, 0.0, 0.0)

    def window(self, others: float, own: float = 1.0, seconds: float = 1.05 * WINDOW_S, waited: float = 0.0) -> None:
        n = self.now
        self.now = CpuTimes(n.wall + seconds, n.busy + (others + own) * seconds, n.own + own * seconds,
                            n.waited + waited)

    def __call__(self) -> CpuTimes:
        return self.now


def governor(cpus: int = 2, max_threads: int = 2, adapt: bool = True) -> tuple[ThreadGovernor, Machine, list[int]]:
    machine, calls = Machine(), []
    return ThreadGovernor(max_threads, adapt, list(range(cpus)), machine, calls.append,
                          lambda: machine.now.wall), machine, calls


def test_one_busy_core_drops_a_thread_at_once_and_a_free_one_brings_it_back_after_two_windows():
    g, machine, calls = governor()
    machine.window(others=0.0)
    assert g.adjust() == 2 and calls == []                    # a free machine: both cores
    machine.window(others=0.67)                               # a busy loop shares the cores with our two threads
    assert g.adjust() == 1 and calls == [1] and g.others == pytest.approx(0.67)
    machine.window(others=1.0)                                # it has its core; we have the other
    assert g.adjust() == 1
    machine.window(others=0.0)
    assert g.adjust() == 1                                    # one free window is not enough
    machine.window(others=0.05)
    assert g.adjust() == 2 and calls == [1, 2] and g.changes == 2


def test_nothing_changes_within_a_window_pinned_or_without_proc():
    g, machine, calls = governor()
    machine.window(others=1.0, seconds=0.55 * WINDOW_S)
    assert g.adjust() == 2                                    # half a window: no look yet
    machine.window(others=1.0, seconds=0.55 * WINDOW_S)
    assert g.adjust() == 1
    pinned, machine, calls = governor(adapt=False)
    machine.window(others=2.0, waited=0.3)
    assert pinned.adjust() == 2 and calls == []
    assert pinned.others == pytest.approx(2.0) and pinned.cpu_wait_s == pytest.approx(0.3)   # still measured
    blind = ThreadGovernor(2, True, [0, 1], lambda: None, calls.append)
    assert not blind.adapt and blind.adjust() == 2 and calls == []


def test_a_pinned_count_holds_until_adapting_again():
    g, machine, calls = governor()
    g.pin(1)                                                  # a benchmark pins one thread
    machine.window(others=0.0)
    assert g.adjust() == 1 and not g.adapt
    g.pin(None)                                               # and adapts again, from the maximum
    assert g.threads == 2 and g.adapt and calls == [1, 2]
    machine.window(others=1.0)
    assert g.adjust() == 1 and calls == [1, 2, 1]


@settings(max_examples=200, deadline=None)
@given(cpus=st.integers(1, 16), max_threads=st.integers(1, 16),
       loads=st.lists(st.floats(0, 16, allow_nan=False), min_size=1, max_size=30))
def test_the_count_stays_within_one_and_the_maximum_and_follows_the_free_cpus(cpus, max_threads, loads):
    g, machine, calls = governor(cpus, max_threads)
    for others in loads:
        before = g.threads
        machine.window(others=min(others, cpus))
        threads = g.adjust()
        assert 1 <= threads <= max_threads
        free = cpus - g.others                                # as measured (float sums of the fake /proc)
        assert g.others == pytest.approx(min(others, cpus), abs=1e-6)
        if threads < before:                                  # dropped: others took more than half a CPU of ours
            assert free < before - 0.5 and threads == max(1, round(free))
        if threads > before:                                  # rose: the CPUs it takes were free
            assert free >= before + 0.7 and threads <= free + 0.3
    assert calls == [] or calls[-1] == g.threads


def test_the_reader_sees_another_programs_cpu_as_others():
    """A busy child process is another program: its CPU counts in `others`, ours does not."""
    reader = CpuReader(usable_cpus())
    if reader() is None:
        pytest.skip("no /proc here")
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        before = reader()
        time.sleep(0.6)
        after = reader()
    finally:
        child.kill()
        child.wait()
    wall = after.wall - before.wall
    others = ((after.busy - before.busy) - (after.own - before.own)) / wall
    assert others > 0.5, others                               # it ran most of the time
    assert after.waited >= before.waited


def test_outputs_are_the_same_bits_at_one_and_two_threads(default_model_path):
    """Greedy tokens and every logprob, prompt and output, batched with a long prompt's chunks: the
    kernels' reductions do not depend on the thread count, so the governor may change it any step."""
    from phasewise import LLM, SamplingParams

    llm = LLM(kv_cache_memory=0.1, max_num_batched_tokens=64, enable_prefix_caching=False, threads=2, warmup=False)
    prompts = ["The history of the printing press begins " * 12, "def fibonacci(n):", "Paris is"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=12)

    def run() -> list:
        outs = llm.generate(prompts, params) + llm.generate(prompts, sampled)
        return [(o.token_ids, repr(o.logprobs), repr(o.prompt_logprobs)) for o in outs]
    before = torch.get_num_threads()
    try:
        results = {}
        for n in (2, 1):
            torch.set_num_threads(n)
            results[n] = run()
            assert {s.extras.threads for s in llm.engine.steps[-4:]} == {n}   # the steps say so
    finally:
        torch.set_num_threads(before)
    assert results[1] == results[2]
