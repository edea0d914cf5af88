"""Which ISA levels a CPU runs, and PHASEWISE_ISA: from feature sets as /proc/cpuinfo names them."""

from __future__ import annotations

import pytest

from phasewise.kernels.isa import ISAError, chosen_level, runnable_levels

ZEN3 = frozenset("sse2 avx avx2 fma f16c bmi1 bmi2 movbe abm".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}      # AVX-512 without VNNI
ALDER_LAKE = ZEN3 | {"avx_vnni"}


def names(features, arch="x86_64"):
    return [lv.name for lv in runnable_levels(features, arch)]


def test_levels_by_cpu():
    assert names(ZEN4) == ["generic", "avx2", "avx512"]
    assert names(ZEN3) == ["generic", "avx2"]
    assert names(SKYLAKE_X) == ["generic", "avx2"]          # the avx512 level needs VNNI
    assert names(frozenset({"sse2"})) == ["generic"]
    assert names(frozenset({"asimd", "asimddp"}), "aarch64") == ["generic", "neon", "neon-dotprod"]
    assert names(frozenset({"asimd"}), "aarch64") == ["generic", "neon"]
    assert names(ZEN4, "riscv64") == []


def test_avx_vnni_joins_the_avx2_level_where_the_cpu_has_it():
    avx2 = [lv for lv in runnable_levels(ALDER_LAKE, "x86_64") if lv.name == "avx2"][0]
    assert "-mavxvnni" in avx2.flags
    assert "-mavxvnni" not in [lv for lv in runnable_levels(ZEN3, "x86_64") if lv.name == "avx2"][0].flags


def test_phasewise_isa_picks_a_lower_level_and_refuses_a_higher_one():
    assert chosen_level(ZEN4, "x86_64", requested="").name == "avx512"
    assert chosen_level(ZEN4, "x86_64", requested="avx2").name == "avx2"
    assert chosen_level(ZEN4, "x86_64", requested="generic").name == "generic"
    with pytest.raises(ISAError, match="cannot run it"):
        chosen_level(ZEN3, "x86_64", requested="avx512")
    with pytest.raises(ISAError, match="not a level of x86_64"):
        chosen_level(ZEN4, "x86_64", requested="neon")
    assert chosen_level(ZEN4, "riscv64", requested="") is None


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_fresh_one_kept(tmp_path):
    """torch's builder waits for its lock without end; a build killed half-way must not hang every
    later run (this hung a session's servers until the lock was removed by hand)."""
    import os
    import time

    from phasewise.kernels import build

    old, fresh = tmp_path / "old" / "lock", tmp_path / "fresh" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir()
        lock.touch()
    stale = time.time() - build.STALE_LOCK_S - 60
    os.utime(old, (stale, stale))
    build._clear_stale_lock(old)
    build._clear_stale_lock(fresh)
    build._clear_stale_lock(tmp_path / "none" / "lock")
    assert not old.exists() and fresh.exists()
