"""The end of bench/gpu_check.sh: one summary of its steps, and the RESULTS.md sections.

    python -m bench.gpu_check_report OUT STEPS.tsv --device cuda --python cp312 --budget 480

STEPS.tsv has one line per step, as the script records it: name, status (passed, failed,
timed out, skipped), exit code, seconds, time limit, and a detail (pytest's counts line, or
why the step was skipped). Writes OUT/summary.json, and OUT/RESULTS.md with the sections
bench/kernels.py and bench/gpu_engine.py rendered (OUT/kernels.json, OUT/kernels-engine.json)
for pasting into bench/RESULTS.md; prints the steps as a table, last, so a device call's
reply shows it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# bench/kernels.py's and bench/gpu_engine.py's JSON payloads and the markdown section each carries.
SECTIONS = (("kernels.json", "kernels_section"), ("kernels-engine.json", "engine_section"))


def read_steps(path: Path) -> list[dict[str, Any]]:
    steps = []
    for line in path.read_text().splitlines():
        name, status, rc, seconds, limit, detail = line.split("\t", 5)
        steps.append(
            {
                "name": name,
                "status": status,
                "rc": None if rc == "" else int(rc),
                "seconds": round(float(seconds), 1),
                "limit_s": int(limit),
                "detail": detail,
            }
        )
    return steps


def collect_sections(out: Path) -> list[str]:
    sections = []
    for filename, key in SECTIONS:
        path = out / filename
        if path.is_file():
            section = json.loads(path.read_text()).get(key)
            if section:
                sections.append(section.rstrip() + "\n")
    return sections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--python", required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--wall", type=float, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    steps = read_steps(args.steps)
    ok = all(step["status"] in ("passed", "skipped") for step in steps)
    summary = {
        "ok": ok,
        "device": args.device,
        "python": args.python,
        "quick": args.quick,
        "budget_s": args.budget,
        "wall_s": round(args.wall, 1),
        "steps": steps,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    sections = collect_sections(args.out)
    if sections:
        (args.out / "RESULTS.md").write_text("\n".join(sections))

    width = max(len(step["name"]) for step in steps)
    for step in steps:
        print(
            f"{step['name']:<{width}}  {step['status']:<9} {step['seconds']:6.1f}s "
            f"/ {step['limit_s']:>3}s  {step['detail']}"
        )
    verdict = "all steps passed or were skipped" if ok else "SOME STEPS DID NOT PASS"
    print(f"{args.device}, {args.python}: {verdict}; {args.wall:.0f}s of {args.budget}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
