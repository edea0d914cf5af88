"""docs/benchmarks.md's "current figures" table is what the results JSON in docs/results/ say
(benchmarks/current_figures.py renders it): a hand edit, or a result written without re-rendering,
fails here."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("current_figures", ROOT / "benchmarks" / "current_figures.py")
current_figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(current_figures)


def test_the_current_figures_table_is_what_the_results_say():
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert current_figures.rendered(doc) == doc, "docs/benchmarks.md is stale: run benchmarks/current_figures.py"
    assert current_figures.rows(), "no results to render"


def test_a_newer_result_replaces_its_row(tmp_path):
    for path in (ROOT / "docs" / "results").glob("scaling*.json"):
        shutil.copy(path, tmp_path / path.name)
    before = {(r["model"], r["isa"]): r for r in current_figures.rows(tmp_path)}
    model, isa = next(iter(before))
    newest = max(tmp_path.glob("scaling*.json"), key=lambda p: json.loads(p.read_text())["date"])
    report = json.loads(newest.read_text())
    report["date"], report["isa"] = "9999-01-01T00:00:00+00:00", isa
    report["rows"] = [r for r in report["rows"] if r["model"] == model] or report["rows"][:1]
    report["rows"][0] |= {"model": model}
    report["rows"][0]["phasewise"] |= {"decode_tps": 1234.5, "isa": isa}
    (tmp_path / "scaling_later.json").write_text(json.dumps(report))
    after = {(r["model"], r["isa"]): r for r in current_figures.rows(tmp_path)}
    assert after[(model, isa)]["file"] == "scaling_later.json" and after[(model, isa)]["decode"].startswith("1,234.5")
    assert {k: v for k, v in after.items() if k != (model, isa)} == \
        {k: v for k, v in before.items() if k != (model, isa)}
