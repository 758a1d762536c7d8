"""The frontier study's runs side by side: each candidate's AP1 above (+) or below (-) the WiSE-FT curve.

    python -m benchmarks.forgetting.summarize_frontier                       # every results/frontier_*.json
    python -m benchmarks.forgetting.summarize_frontier results/frontier_facts.json results/frontier_questions.json

Prints a markdown table: one row per candidate (frontier points, then the study's variants), one column per run,
each cell "margin (AP2, Jacobian evaluations)"; empty where a run did not have that candidate. Reads only what
frontier_study.py wrote; changes nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def column_name(data: dict) -> str:
    replay = data.get("facts_replay", 256)
    return f"{data['scenario']}, {data['method']}, seed {data['seed']}" + (f", θ0 with {replay} replay pairs"
                                                                          if replay != 256 else "")


def rows_of(data: dict) -> list[dict]:
    """Scored JANUS candidates and variants (WiSE-FT and the anchors define the curve, they have no margin)."""
    points = [p for p in data["frontier"]["points"] if p["kind"] not in ("anchor", "wise")]
    # runs written before the variants were generalized kept them under "replay_variants"
    return points + data.get("variants", data.get("replay_variants", []))


def cell(row: dict) -> str:
    if row.get("above_wise") is None:
        return f"off the curve ({row['ap2']:.1f}, {row['jacobian_evaluations']})"
    evals = row.get("jacobian_evaluations") or 0
    return f"{row['above_wise']:+.1f} ({row['ap2']:.1f}{f', {evals}' if evals else ''})"


def chosen(data: dict) -> str:
    front = data["frontier"]
    if front.get("chosen") is None:
        return ""
    best = front["points"][front["chosen"]]
    return f"{best['label']} ({best['ap1']:.1f} / {best['ap2']:.1f})"


def table(runs: list[dict]) -> str:
    labels: list[str] = []
    cells: dict[tuple[str, int], str] = {}
    for i, data in enumerate(runs):
        for row in rows_of(data):
            cells[(row["label"], i)] = cell(row)
    # rows in the order of the run with the most candidates, then any others
    for data in sorted(runs, key=lambda d: -len(rows_of(d))):
        for row in rows_of(data):
            if row["label"] not in labels:
                labels.append(row["label"])
    head = "| candidate | " + " | ".join(column_name(d) for d in runs) + " |"
    lines = [head, "|---|" + "---:|" * len(runs)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(cells.get((label, i), "") for i in range(len(runs))) + " |")
    lines.append("| chosen at AP2 ≥ 90 (AP1 / AP2) | " + " | ".join(chosen(d) for d in runs) + " |")
    lines.append("| wall time | " + " | ".join(f"{d['wall_seconds'] / 60:.0f} min" for d in runs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="frontier_study.py result JSONs (default: every results/frontier_*.json)")
    args = ap.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(HERE, "results", "frontier_*.json")))
    if not files:
        print("no frontier_*.json results: run frontier_study.py first", file=sys.stderr)
        return 1
    runs = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            runs.append(json.load(fh))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
