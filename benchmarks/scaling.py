"""How phasewise's costs grow with model size, next to llama.cpp's on the same GGUF files, in one run.

    .venv/bin/python benchmarks/scaling.py --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,syn:3b,syn:7b
        [--arch qwen2] [--llama-cpp .peers/avx512/bin] [--output-len 128] [--input-len 512]
        [--repeats 2] [--threads N] [--tmp /tmp] [--out docs/results/scaling]

A model is a packaged model's name, a .gguf path, or `syn:SIZE` (0.5b … 8b; a mixture of experts'
1b-7b, 30b-a3b, 8x1b): a random Q4_K_M-style file of that --arch shape that benchmarks/synthetic_gguf.py writes into --tmp, deleted afterwards with
its packed-weight cache entry, whatever happens. Each phasewise figure comes from a fresh process:

- load s: `LLM(model)` until ready (warm-up included); "first" whatever the packed-weight cache held
  (first_cache_present says), "cached" in a second process that maps what the first one packed;
- peak GB: ru_maxrss of the measuring process (the first load's is first_peak_rss_gb; VmRSS after
  load is rss_after_load_gb); llama.cpp's: llama-bench's ru_maxrss;
- decode tok/s: (--output-len − 1) / first-to-last-token time of a greedy run from an 8-token
  prompt (llama.cpp: llama-bench's tg<output-len>); prefill tok/s: --input-len distinct ids /
  scheduling-to-first-token time (prefill_wall_tps: the whole generate call; llama.cpp: pp<prompt>);
  phasewise's are medians of --repeats, llama-bench's means;
- bytes/token: what a decode step reads, the file less the token table (kept when tied: it is the
  head), and of a mixture of experts' expert tensors only the share a token uses; decode GB/s = bytes/token × decode tok/s, "of DRAM" its share of the DRAM read bandwidth;
- roofs (`phasewise roofline`'s cached machine figures, measured if absent): decode ≤ DRAM GB/s /
  bytes/token, prefill ≤ int8 GOP/s / (2 × parameters; of a mixture of experts the active ones).

Writes <out>.json (machine, roofs, a row per model), <out>.png (both rates against parameters) and
prints a table (pw = phasewise, lc = llama.cpp, × = pw/lc).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@scaling "                  # the child's result line


def child(path: str, phase: str, args: argparse.Namespace) -> None:
    """One phasewise measurement in this fresh process ("load" or "measure"): one MARK + JSON line."""
    import resource

    import torch

    from phasewise import LLM, SamplingParams
    from phasewise.lab.roofline import linear_params, weight_bytes_per_param
    from phasewise.loading import packed_cache

    torch.set_num_threads(args.threads)
    present = packed_cache.wanted(Path(path)) and packed_cache.cache_path(Path(path)).exists()
    t = time.perf_counter()
    llm = LLM(model=path)
    status = Path("/proc/self/status").read_text().split("VmRSS:")[1].split()
    res: dict[str, Any] = {"load_s": time.perf_counter() - t, "cache_present": present,
                           "rss_after_load_gb": int(status[0]) * 1024 / 1e9, "precision": llm.engine.precision.weights,
                           "isa": llm.engine.kernels.isa if llm.engine.kernels is not None else "torch"}
    if phase == "measure":
        cfg, n = llm.model_config, args.input_len
        res["packed_weight_bytes"] = int(linear_params(cfg) * weight_bytes_per_param(llm.engine.model, cfg, 4))
        llm.generate([[900 + i for i in range(8)]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        decode, prefill, wall = [], [], []
        for r in range(args.repeats):             # fresh prompts: no prefix-cache hits
            out = llm.generate([[1000 + 8 * r + i for i in range(8)]],
                               SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))[0]
            decode.append((len(out.token_ids) - 1) / (out.metrics.decode_ms / 1e3))
            t = time.perf_counter()
            out = llm.generate([[(2000 + n * r + i) % cfg.vocab_size for i in range(n)]],
                               SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
            wall.append(n / (time.perf_counter() - t))
            prefill.append(n / (out.metrics.prompt_ms / 1e3))
        res.update(decode_tps=statistics.median(decode), prefill_tps=statistics.median(prefill),
                   prefill_wall_tps=statistics.median(wall))
    res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(MARK + json.dumps(res), flush=True)


def run(cmd: list[str]) -> tuple[int, str, str, float]:
    """Exit code, stdout, stderr and peak RSS (GB) of a command."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)                  # its own rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return proc.returncode, out, err.read().decode(errors="replace"), usage.ru_maxrss * 1024 / 1e9


def phasewise_run(path: Path, phase: str, args: argparse.Namespace) -> dict[str, Any]:
    keys = ("output_len", "input_len", "repeats", "threads")
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    rc, out, err, _ = run([sys.executable, __file__, "--child", str(path), "--phase", phase, *flags])
    line = next((x for x in out.splitlines() if x.startswith(MARK)), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"phasewise {phase} run failed (exit {rc}): {err.strip()[-600:]}")
    return json.loads(line[len(MARK):])


def llama_bench(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    exe = args.llama_cpp / "llama-bench"
    if not exe.exists():
        return {"skipped": f"no llama-bench in {args.llama_cpp} (make peers)"}
    rc, out, err, peak = run([str(exe), "-m", str(path), "-p", str(args.input_len), "-n", str(args.output_len),
                              "-t", str(args.threads), "-r", str(args.repeats), "-o", "json"])
    if rc != 0:
        return {"skipped": f"llama-bench failed (exit {rc}): {err.strip()[-400:]}"}
    rows = json.loads(out)
    ts = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    return {"prefill_tps": ts.get((args.input_len, 0)), "decode_tps": ts.get((0, args.output_len)),
            "peak_rss_gb": peak, "build": f"{rows[0].get('build_commit')} {args.llama_cpp.parent.name}",
            "n_params": rows[0].get("model_n_params")}


def describe(path: Path) -> dict[str, Any]:
    """File size, parameters, and what a token reads and computes: all but the token table (unless
    tied), of a mixture of experts only the `expert_used_count` of each layer's experts (active)."""
    from phasewise.loading.gguf import GGUFFile

    gguf = GGUFFile(path)
    tensors, size = gguf.tensors, path.stat().st_size
    tied = "output.weight" not in tensors
    arch = gguf.fields.get("general.architecture")
    experts, used = gguf.fields.get(f"{arch}.expert_count", 0), gguf.fields.get(f"{arch}.expert_used_count", 0)
    idle = 1 - used / experts if experts else 0.0            # the share of expert weights a token skips
    exps = [t for n, t in tensors.items() if "_exps." in n]
    params = sum(math.prod(t.shape) for t in tensors.values())
    row = {"file_bytes": size, "tied": tied, "params": params,
           "bytes_per_token": size - (0 if tied else tensors["token_embd.weight"].nbytes)
           - idle * sum(t.nbytes for t in exps)}
    if experts:
        row.update(experts=experts, experts_used=used,
                   active_params=params - idle * sum(math.prod(t.shape) for t in exps))
    return row


def forget_packed(path: Path) -> None:
    """Delete phasewise's packed-weight cache entry of `path`'s content (and its partial writes)."""
    from phasewise.loading import packed_cache

    store = packed_cache.store()
    store.remove(packed_cache.cache_path(path))
    for partial in store.folder.glob(f".{path.stem}-*.partial"):
        partial.unlink(missing_ok=True)


def measure(name: str, args: argparse.Namespace, machine: Any) -> dict[str, Any]:
    from phasewise.loading.loader import resolve_model_path

    row: dict[str, Any] = {"model": name}
    synthetic = name.startswith("syn:")
    path = (args.tmp / f"phasewise-scaling-{args.arch}-{name[4:]}.gguf").resolve() if synthetic else None
    try:
        if synthetic:
            rc, _, err, _ = run([sys.executable, str(ROOT / "benchmarks" / "synthetic_gguf.py"), "--size", name[4:],
                                 "--arch", args.arch, "--out", str(path), "--force"])
            if rc != 0:
                raise RuntimeError(f"synthetic_gguf.py failed: {err.strip()[-400:]}")
        else:
            path = resolve_model_path(name)
        row.update(path=str(path), **describe(path))
        try:
            first = phasewise_run(path, "load", args)
            cached = phasewise_run(path, "measure", args)
            row["phasewise"] = {**cached, "first_load_s": first["load_s"], "first_peak_rss_gb": first["peak_rss_gb"],
                                "first_cache_present": first["cache_present"]}
            row["phasewise"]["cached_load_s"] = row["phasewise"].pop("load_s")
            row["phasewise"]["cached_cache_present"] = row["phasewise"].pop("cache_present")
        except RuntimeError as e:
            row["phasewise"] = {"error": str(e)}
        row["llama_cpp"] = llama_bench(path, args)
    except Exception as e:                              # noqa: BLE001 - the other models still run
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if synthetic:
            path.unlink(missing_ok=True)
            forget_packed(path)
    return with_roofs(row, machine)


def with_roofs(row: dict[str, Any], machine: Any) -> dict[str, Any]:
    """The row's roofs and its decodes' share of the DRAM roof, by the machine's figures."""
    if "bytes_per_token" in row:
        row["decode_roof_tps"] = machine.dram_gbs * 1e9 / row["bytes_per_token"]
        row["prefill_roof_tps"] = (machine.int8_gops or machine.matmul_gflops) * 1e9 / \
            (2 * row.get("active_params", row["params"]))
        for d in (row.get("phasewise", {}), row.get("llama_cpp", {})):
            if d.get("decode_tps"):
                d["decode_gbs"] = row["bytes_per_token"] * d["decode_tps"] / 1e9
                d["dram_share"] = d["decode_gbs"] / machine.dram_gbs
    return row


def table(rows: list[dict[str, Any]]) -> None:
    def f(v: Any, spec: str = ".1f") -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    def pair(p: dict, lc: dict, key: str, spec: str = ".1f", ratio: bool = False) -> str:
        a, b = p.get(key), lc.get(key)
        return f"{f(a, spec):>9}/{f(b, spec):<7}" + (f"{a / b:5.2f}" if a and b else "    -") * ratio

    print(f"\n{'model':20}{'params':>8}{'file GB':>8}{'load 1st/cached s':>19}{'peak GB pw/lc':>15}"
          f"{'decode tok/s pw/lc  ×':>22}{'roof':>7}{'DRAM':>6}{'prefill tok/s pw/lc  ×':>23}{'roof':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:20} error: {r['error']}")
            continue
        p, lc = r.get("phasewise", {}), r.get("llama_cpp", {})
        print(f"{r['model']:20}{r['params'] / 1e9:7.2f}B{r['file_bytes'] / 1e9:8.2f}"
              f"{f(p.get('first_load_s')):>11}/{f(p.get('cached_load_s')):<7}"
              f"{pair(p, lc, 'peak_rss_gb', '.2f')}{pair(p, lc, 'decode_tps', ratio=True)}"
              f"{r['decode_roof_tps']:7.1f}{f(p.get('dram_share'), '.0%'):>6}"
              f"{pair(p, lc, 'prefill_tps', ratio=True)}{r['prefill_roof_tps']:7.0f}")
        for who, d in (("phasewise", p), ("llama.cpp", lc)):
            if d.get("error") or d.get("skipped"):
                print(f"{'':20} {who}: {d.get('error') or d.get('skipped')}")


def plot(rows: list[dict[str, Any]], png: Path, machine: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if "params" in r), key=lambda r: r["params"])
    x = [r["params"] for r in rows]
    compute = machine.int8_gops or machine.matmul_gflops
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, phase, roof in ((axes[0], "decode", f"DRAM roof ({machine.dram_gbs:.0f} GB/s)"),
                            (axes[1], "prefill", f"int8 roof ({compute:.0f} GOP/s)")):
        for who, style in (("phasewise", "o-"), ("llama_cpp", "s-")):
            pts = [(xi, r.get(who, {}).get(f"{phase}_tps")) for xi, r in zip(x, rows)]
            if pts := [(a, b) for a, b in pts if b]:
                ax.plot(*zip(*pts), style, label=who.replace("_", "."))
        ax.plot(x, [r[f"{phase}_roof_tps"] for r in rows], "k--", marker="_", ms=14, label=roof)
        for xi, r in zip(x, rows):
            ax.annotate(r["model"], (xi, r[f"{phase}_roof_tps"]), fontsize=7, textcoords="offset points",
                        xytext=(2, -10))
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="tokens/s", title=f"{phase} (batch 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,syn:3b,syn:7b")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "olmoe", "qwen3moe", "mixtral", "qwen35", "qwen35moe", "lfm2"],
                    help="shape of the syn: models (benchmarks/synthetic_gguf.py --list)")
    ap.add_argument("--llama-cpp", type=Path, help="llama-bench's folder (default: .peers/avx512/bin if it "
                                                   "exists, else .peers/native/bin)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both systems")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"), help="where syn: files are written")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "scaling")
    ap.add_argument("--remeasure", action="store_true", help="measure the machine's roofs again first (the "
                    "kept figures may come from a busy moment)")
    ap.add_argument("--render", type=Path, help="redraw the table and plot of this results JSON with the kept "
                    "machine figures (no run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.phase, args)
    if args.llama_cpp is None:
        avx512 = ROOT / ".peers" / "avx512" / "bin"
        args.llama_cpp = avx512 if avx512.exists() else ROOT / ".peers" / "native" / "bin"

    import torch

    from phasewise.lab.roofline import load_machine, measure_machine, save_machine

    torch.set_num_threads(args.threads)                   # the machine figures are kept per thread count
    if args.remeasure or (machine := load_machine(torch.float32)) is None:
        print("measuring the machine's roofs (kept for next time) ...", flush=True)
        save_machine(machine := measure_machine(torch.float32), torch.float32)
    if args.render:
        report = json.loads(args.render.read_text())
        report["machine"] = dataclasses.asdict(machine)
        report["rows"] = [with_roofs(r, machine) for r in report["rows"]]
        args.render.write_text(json.dumps(report, indent=1))
        plot(report["rows"], args.render.with_suffix(".png"), machine)
        table(report["rows"])
        print(f"\nDRAM {machine.dram_gbs:.1f} GB/s, int8 {machine.int8_gops or 0:.0f} GOP/s; rewrote {args.render}")
        return
    from run_record import run_record

    record = run_record("scaling", args.threads)
    if (load := record["loadavg_before"]) > 0.5:
        print(f"warning: load average {load:.1f} before starting: other processes slow every figure", flush=True)
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        print(f"{name} ...", flush=True)
        rows.append(measure(name, args, machine))
    report = {**record, "llama_cpp": str(args.llama_cpp), "machine": dataclasses.asdict(machine), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out.with_name(args.out.name + ".json"), args.out.with_name(args.out.name + ".png")
    json_path.write_text(json.dumps(report, indent=1))
    plot(rows, png_path, machine)
    table(rows)
    print(f"\n{report['cpu']}, ISA {report['isa']}, {args.threads} threads; DRAM {machine.dram_gbs:.1f} GB/s, int8 "
          f"{machine.int8_gops or 0:.0f} GOP/s; pw = phasewise, lc = llama.cpp\nwrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
