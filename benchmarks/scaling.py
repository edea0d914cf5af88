"""How phasewise's costs grow with model size, next to llama.cpp's on the same GGUF files, in one run.

    .venv/bin/python benchmarks/scaling.py --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,syn:3b,syn:7b
        [--arch qwen2] [--llama-cpp .peers/avx512/bin] [--decode-tokens 128] [--prompt-tokens 512]
        [--repeats 2] [--threads N] [--tmp /tmp] [--out docs/results/scaling]

A model is a packaged model's name, a .gguf path, or `syn:SIZE` (0.5b, 1.5b, 3b, 7b, 8b): a file of
that shape (--arch) with random Q4_K_M-style blocks that benchmarks/synthetic_gguf.py writes into
--tmp; it is deleted after its measurements, with phasewise's packed-weight cache entry for it,
whatever happens. Each phasewise figure comes from a fresh process, so its memory is that model's:

- first load s: `LLM(model)` until ready (including warm-up), whatever the packed-weight cache held
  (`cache` says whether it had this file); cached load s: the same in a second process, which maps
  the packed weights the first one wrote;
- peak RSS GB: the process's ru_maxrss (load and all runs); RSS after load: VmRSS once loaded;
  llama.cpp's: llama-bench's ru_maxrss;
- decode tok/s: (--decode-tokens − 1) / time from the first to the last token of a greedy run from
  an 8-token prompt, median of --repeats (llama.cpp: llama-bench's tg<decode-tokens>);
- prefill tok/s: --prompt-tokens distinct token ids / time from scheduling to the first token,
  median of --repeats (`prefill wall`: the whole generate call); llama.cpp: pp<prompt-tokens>;
- bytes/token: what a decode step reads, the GGUF's bytes less the token table (counted again
  when it is tied, as the output head); decode GB/s = bytes/token × decode tok/s, and its share of
  the machine's DRAM read bandwidth;
- roofs (from `phasewise roofline`'s cached figures, measured here if absent): decode ≤ DRAM GB/s /
  bytes/token; prefill ≤ int8 GOP/s / (2 × parameters).

Writes <out>.json (machine, roofs, one row per model) and <out>.png (both rates against parameters).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@scaling "


def child(path: str, phase: str, decode_tokens: int, prompt_tokens: int, repeats: int) -> None:
    """One phasewise measurement in this fresh process; prints one MARK-prefixed JSON line."""
    import resource

    from phasewise import LLM, SamplingParams
    from phasewise.loading import packed_cache

    gguf = Path(path)
    present = packed_cache.wanted(gguf) and packed_cache.cache_path(gguf).exists()
    t = time.perf_counter()
    llm = LLM(model=path)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t, "cache_present": present,
                           "rss_after_load_gb": _vmrss_gb(), "precision": llm.engine.precision.weights,
                           "isa": llm.engine.kernels.isa if llm.engine.kernels is not None else "torch"}
    if phase == "measure":
        from phasewise.lab.roofline import linear_params, weight_bytes_per_param

        cfg, vocab = llm.model_config, llm.model_config.vocab_size
        res["packed_weight_bytes"] = int(linear_params(cfg) * weight_bytes_per_param(llm.engine.model, cfg, 4))
        greedy = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
        llm.generate([[900 + i for i in range(8)]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        decode, prefill, wall = [], [], []
        for r in range(repeats):
            out = llm.generate([[1000 + 8 * r + i for i in range(8)]], greedy)[0]
            decode.append((len(out.token_ids) - 1) / (out.metrics.decode_ms / 1e3))
            ids = [(2000 + prompt_tokens * r + i) % vocab for i in range(prompt_tokens)]
            t = time.perf_counter()
            out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
            wall.append(prompt_tokens / (time.perf_counter() - t))
            prefill.append(prompt_tokens / (out.metrics.prompt_ms / 1e3))
        res.update(decode_tps=statistics.median(decode), prefill_tps=statistics.median(prefill),
                   prefill_wall_tps=statistics.median(wall))
    res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(MARK + json.dumps(res), flush=True)


def _vmrss_gb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024 / 1e9


def run(cmd: list[str]) -> tuple[int, str, str, float]:
    """Exit code, stdout, stderr and peak RSS (GB) of a command."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)       # reaped here: keeps Popen quiet
        err.seek(0)
        return proc.returncode, out, err.read().decode(errors="replace"), usage.ru_maxrss * 1024 / 1e9


def phasewise_run(path: Path, phase: str, args) -> dict[str, Any]:
    rc, out, err, _ = run([sys.executable, __file__, "--child", str(path), "--phase", phase,
                           "--decode-tokens", str(args.decode_tokens), "--prompt-tokens", str(args.prompt_tokens),
                           "--repeats", str(args.repeats)])
    line = next((x for x in out.splitlines() if x.startswith(MARK)), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"phasewise {phase} run failed (exit {rc}): {err.strip()[-600:]}")
    return json.loads(line[len(MARK):])


def llama_bench(path: Path, args) -> dict[str, Any]:
    exe = args.llama_cpp / "llama-bench"
    if not exe.exists():
        return {"skipped": f"no llama-bench in {args.llama_cpp} (make peers)"}
    rc, out, err, peak = run([str(exe), "-m", str(path), "-p", str(args.prompt_tokens), "-n", str(args.decode_tokens),
                              "-t", str(args.threads), "-r", str(args.repeats), "-o", "json"])
    if rc != 0:
        return {"skipped": f"llama-bench failed (exit {rc}): {err.strip()[-400:]}"}
    rows = json.loads(out)
    ts = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    return {"prefill_tps": ts.get((args.prompt_tokens, 0)), "decode_tps": ts.get((0, args.decode_tokens)),
            "peak_rss_gb": peak, "build": f"{rows[0].get('build_commit')} {args.llama_cpp.parent.name}",
            "n_params": rows[0].get("model_n_params")}


def describe(path: Path) -> dict[str, Any]:
    from phasewise.loading.gguf import GGUFFile

    tensors = GGUFFile(path).tensors
    embd = tensors["token_embd.weight"].nbytes
    tied = "output.weight" not in tensors
    size = path.stat().st_size
    return {"file_bytes": size, "tied": tied, "params": sum(_numel(t.shape) for t in tensors.values()),
            "bytes_per_token": size - (0 if tied else embd)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def forget_packed(path: Path) -> None:
    """Delete phasewise's packed-weight cache entries (and partial writes) made from `path`."""
    from phasewise.paths import default_cache_dir

    folder, target = default_cache_dir() / "packed", str(path.resolve())
    for src in folder.glob("*.src"):
        try:
            if str(Path(src.read_text().strip()).resolve()) == target:
                src.with_suffix(".pt").unlink(missing_ok=True)
                src.unlink(missing_ok=True)
        except OSError:
            continue
    for partial in folder.glob(f".{path.stem}-*.partial"):
        partial.unlink(missing_ok=True)


def measure(name: str, args, machine) -> dict[str, Any]:
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
            row["phasewise"] = {**{k: cached[k] for k in cached if k not in ("load_s", "cache_present")},
                                "first_load_s": first["load_s"], "first_cache_present": first["cache_present"],
                                "first_peak_rss_gb": first["peak_rss_gb"], "cached_load_s": cached["load_s"],
                                "cached_cache_present": cached["cache_present"]}
        except RuntimeError as e:
            row["phasewise"] = {"error": str(e)}
        row["llama_cpp"] = llama_bench(path, args)
    except Exception as e:                                  # noqa: BLE001 - the other models still run
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if synthetic:
            path.unlink(missing_ok=True)
            forget_packed(path)
    if "bytes_per_token" in row:
        row["decode_roof_tps"] = machine.dram_gbs * 1e9 / row["bytes_per_token"]
        row["prefill_roof_tps"] = (machine.int8_gops or machine.matmul_gflops) * 1e9 / (2 * row["params"])
        for sys_ in ("phasewise", "llama_cpp"):
            if row.get(sys_, {}).get("decode_tps"):
                gbs = row["bytes_per_token"] * row[sys_]["decode_tps"] / 1e9
                row[sys_].update(decode_gbs=gbs, dram_share=gbs / machine.dram_gbs)
    return row


def roofs():
    import torch

    from phasewise.lab.roofline import load_machine, measure_machine, save_machine

    machine = load_machine(torch.float32)
    if machine is None:
        print("measuring the machine's roofs (cached for next time) ...", flush=True)
        machine = measure_machine(torch.float32)
        save_machine(machine, torch.float32)
    return machine


def table(rows: list[dict[str, Any]]) -> None:
    def f(v: Any, spec: str = ".1f") -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    def ratio(a: Any, b: Any) -> str:
        return f"{a / b:.2f}" if a and b else "-"

    print(f"\n{'model':22}{'params':>8}{'file GB':>8}{'load 1st/cached s':>19}{'peak GB pw/lc':>15}"
          f"{'decode pw/lc tok/s':>20}{'×':>6}{'roof':>7}{'of DRAM':>8}{'prefill pw/lc tok/s':>21}{'×':>6}{'roof':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:22} error: {r['error']}")
            continue
        p, lc = r.get("phasewise", {}), r.get("llama_cpp", {})
        print(f"{r['model']:22}{r['params'] / 1e9:7.2f}B{r['file_bytes'] / 1e9:8.2f}"
              f"{f(p.get('first_load_s')):>10}/{f(p.get('cached_load_s')):<8}"
              f"{f(p.get('peak_rss_gb'), '.2f'):>8}/{f(lc.get('peak_rss_gb'), '.2f'):<6}"
              f"{f(p.get('decode_tps')):>11}/{f(lc.get('decode_tps')):<8}{ratio(p.get('decode_tps'), lc.get('decode_tps')):>6}"
              f"{r['decode_roof_tps']:7.1f}{f(p.get('dram_share'), '.0%'):>8}"
              f"{f(p.get('prefill_tps')):>12}/{f(lc.get('prefill_tps')):<8}"
              f"{ratio(p.get('prefill_tps'), lc.get('prefill_tps')):>6}{r['prefill_roof_tps']:8.1f}")
        for sys_, d in (("phasewise", p), ("llama.cpp", lc)):
            if d.get("error") or d.get("skipped"):
                print(f"{'':22} {sys_}: {d.get('error') or d.get('skipped')}")


def plot(rows: list[dict[str, Any]], png: Path, machine) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if "params" in r), key=lambda r: r["params"])
    x = [r["params"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, roof, label in ((axes[0], "decode_tps", "decode_roof_tps", f"DRAM roof ({machine.dram_gbs:.0f} GB/s)"),
                                 (axes[1], "prefill_tps", "prefill_roof_tps",
                                  f"int8 roof ({machine.int8_gops or machine.matmul_gflops:.0f} GOP/s)")):
        for sys_, style in (("phasewise", "o-"), ("llama_cpp", "s-")):
            pts = [(xi, r.get(sys_, {}).get(key)) for xi, r in zip(x, rows)]
            pts = [(a, b) for a, b in pts if b]
            if pts:
                ax.plot(*zip(*pts), style, label=sys_.replace("_", "."))
        ax.plot(x, [r[roof] for r in rows], "k--", label=label)
        for xi, r in zip(x, rows):
            ax.annotate(r["model"], (xi, r[roof]), fontsize=7, textcoords="offset points", xytext=(2, 4))
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="tokens/s",
               title="decode (batch 1)" if key == "decode_tps" else "prefill (batch 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,syn:3b,syn:7b")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"], help="shape of the syn: models")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="folder of llama-bench (default: .peers/avx512/bin "
                                                                 "if present, else .peers/native/bin)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-bench's threads")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"), help="where syn: files are written")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "scaling")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.phase, args.decode_tokens, args.prompt_tokens, args.repeats)
    if args.llama_cpp is None:
        avx512 = ROOT / ".peers" / "avx512" / "bin"
        args.llama_cpp = avx512 if avx512.exists() else ROOT / ".peers" / "native" / "bin"

    from phasewise.kernels.isa import chosen_level

    machine = roofs()
    level = chosen_level()
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "unknown")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        print(f"{name} ...", flush=True)
        rows.append(measure(name, args, machine))
    report = {"commit": commit, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "cpu": cpu, "isa": level.name if level else None, "command": " ".join(sys.argv),
              "llama_cpp": str(args.llama_cpp), "threads": args.threads, "machine": dataclasses.asdict(machine), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out.with_name(args.out.name + ".json"), args.out.with_name(args.out.name + ".png")
    json_path.write_text(json.dumps(report, indent=1))
    plot(rows, png_path, machine)
    table(rows)
    print(f"\n{cpu}, ISA {report['isa']}; DRAM {machine.dram_gbs:.1f} GB/s, int8 {machine.int8_gops or 0:.0f} GOP/s; "
          f"pw = phasewise, lc = llama.cpp, × = pw/lc\nwrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
