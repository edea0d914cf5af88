"""docs/benchmarks.md's "current figures" table, rendered from the results JSON the benchmarks write
(docs/results/scaling*.json from scaling.py, compare_peers*.json from compare_peers.py --json): one
row per model × ISA level × peer, the newest result of each, with its date, commit and file.

    .venv/bin/python benchmarks/current_figures.py           # rewrite the table in docs/benchmarks.md
    .venv/bin/python benchmarks/current_figures.py --check   # exit 1 if the table is not what the JSON says

tests/test_benchmark_docs.py runs the check, so the table cannot drift from the results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- current figures: benchmarks/current_figures.py writes this table -->", "<!-- end of current figures -->"
HEADER = ("| model | ISA | peer | decode tok/s pw / peer | prefill tok/s pw / peer | served tok/s pw / peer | "
          "load first / cached (s) | peak RSS pw / peer (GB) | measured | results |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _pair(ours: float | None, theirs: float | None, digits: int = 1) -> str:
    if ours is None or theirs is None:
        return "—"
    return f"{ours:,.{digits}f} / {theirs:,.{digits}f} ({ours / theirs:.2f}x)"


def _scaling_rows(report: dict, name: str) -> list[dict]:
    rows = []
    for r in report["rows"]:
        pw, lc = r.get("phasewise", {}), r.get("llama_cpp", {})
        if "decode_tps" not in pw:
            continue
        first, cached = pw.get("first_load_s"), pw.get("cached_load_s")
        rows.append({"model": r["model"], "isa": report["isa"] or pw.get("isa"), "peer": "llama-bench",
                     "decode": _pair(pw["decode_tps"], lc.get("decode_tps")),
                     "prefill": _pair(pw["prefill_tps"], lc.get("prefill_tps")), "served": "—",
                     "load": "—" if first is None else f"{first:.1f} / {cached:.1f}",
                     "rss": f"{pw['peak_rss_gb']:.2f} / {lc['peak_rss_gb']:.2f}" if "peak_rss_gb" in lc else "—",
                     "date": report["date"], "commit": report["commit"], "file": name})
    return rows


def _compare_rows(report: dict, name: str) -> list[dict]:
    peer = next((r for r in report["rows"] if r["name"].startswith("llama.cpp")), None)
    ours = next((r for r in report["rows"] if r["name"].startswith("phasewise")), None)
    if peer is None or ours is None:
        return []
    return [{"model": report["model"], "isa": report["isa"], "peer": "llama-bench / llama-server",
             "decode": _pair(ours["decode_tps"], peer["decode_tps"]),
             "prefill": _pair(ours["prefill_tps"], peer["prefill_tps"]),
             "served": _pair(ours["served_tps"], peer["served_tps"]), "load": "—", "rss": "—",
             "date": report["date"], "commit": report["commit"], "file": name}]


def rows(results: Path = RESULTS) -> list[dict]:
    """The newest row of each (model, ISA, peer) over every results file."""
    newest: dict[tuple, dict] = {}
    for path in sorted(results.glob("*.json")):
        report = json.loads(path.read_text())
        kind = report.get("benchmark") or ("scaling" if path.name.startswith("scaling") else None)
        found = _scaling_rows(report, path.name) if kind == "scaling" else \
            _compare_rows(report, path.name) if kind == "compare_peers" else []
        for row in found:
            key = (row["model"], row["isa"], row["peer"])
            if key not in newest or row["date"] > newest[key]["date"]:
                newest[key] = row
    return [newest[k] for k in sorted(newest)]


def table(results: Path = RESULTS) -> str:
    lines = [BEGIN, HEADER]
    for r in rows(results):
        lines.append(f"| {r['model']} | {r['isa']} | {r['peer']} | {r['decode']} | {r['prefill']} | {r['served']} | "
                     f"{r['load']} | {r['rss']} | {r['date'][:10]}, `{r['commit'][:7]}` | `{r['file']}` |")
    return "\n".join(lines + [END])


def rendered(doc: str, results: Path = RESULTS) -> str:
    """doc with its table between the markers replaced by the one the results give."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + table(results) + doc[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    args = ap.parse_args()
    doc = DOC.read_text()
    new = rendered(doc)
    if args.check:
        if new != doc:
            print(f"{DOC} is stale: run benchmarks/current_figures.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"rewrote the current figures in {DOC} ({len(rows())} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
