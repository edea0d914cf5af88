"""The replicas' Prometheus texts as one: each sample once per replica, labelled `replica="<its Serve
replica id>"`, and once without that label, summed over the replicas (a `_perc` gauge, a ratio: their
mean). The unlabelled series are what one `phasewise serve` reports, so a scraper or dashboard written for
one server reads the whole deployment; `{replica=~".+"}` selects the replicas' own. No Ray import here."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

REPLICA_LABEL = "replica"
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_COMMENT = re.compile(r"^#\s+(HELP|TYPE)\s+([A-Za-z_:][\w:]*)(?:\s+(.*))?$")


@dataclass
class _Family:
    kind: str = "untyped"
    comments: list[str] = field(default_factory=list)
    samples: list[tuple[str, str, str, float]] = field(default_factory=list)    # replica, name, labels, value


def merge_metrics(texts: dict[str, str]) -> str:
    """{replica id: its /metrics text} → one exposition text: per replica, then in sum (see the module)."""
    families: dict[str, _Family] = {}
    for replica, text in texts.items():
        current: _Family | None = None
        for line in text.splitlines():
            comment = _COMMENT.match(line)
            if comment:
                what, name, rest = comment.groups()
                current = families.setdefault(name, _Family())
                if what == "TYPE":
                    current.kind = (rest or "untyped").strip()
                if line not in current.comments and len(current.comments) < 2:
                    current.comments.append(line)
                continue
            sample = _SAMPLE.match(line)
            if not sample:
                continue
            name, labels, value = sample.groups()
            if current is None or not name.startswith(_family_name(current)):
                current = families.setdefault(name, _Family())
            current.samples.append((replica, name, labels or "", _number(value)))
    out: list[str] = []
    for family in families.values():
        out += family.comments
        sums: dict[tuple[str, str], list[float]] = {}
        for replica, name, labels, value in family.samples:
            mine = f'{REPLICA_LABEL}="{_escape(replica)}"' + (f",{labels}" if labels else "")
            out.append(f"{name}{{{mine}}} {_format(value)}")
            sums.setdefault((name, labels), []).append(value)
        mean = family.kind == "gauge" and any(n.endswith("_perc") for n, _ in sums)
        for (name, labels), values in sums.items():
            total = sum(values) / len(values) if mean else sum(values)
            out.append(f"{name}{{{labels}}} {_format(total)}" if labels else f"{name} {_format(total)}")
    return "\n".join(out) + "\n"


def _family_name(family: _Family) -> str:
    return family.comments[0].split()[2] if family.comments else ""


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _format(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
