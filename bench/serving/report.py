"""How bench/serving/serve.py reports: tables, plots and JSON files."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from bench.serving.load import METRICS


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def sweep_table(rows: list[dict]) -> str:
    """One markdown row per (rate, concurrency): throughputs, goodput, latencies."""
    head = ["rate", "conc", "req/s", "out tok/s", "goodput"]
    head += [f"{m.upper()} mean/p50/p99 ms" for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        cells = [
            str(row["request_rate"]),
            str(row["max_concurrency"] or "-"),
            fmt(row["request_throughput"], 2),
            fmt(row["output_throughput"]),
            fmt(row.get("goodput", float("nan")), 2),
        ]
        for m in METRICS:
            cells.append(" / ".join(fmt(row[f"{k}_{m}_ms"]) for k in ("mean", "p50", "p99")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], x_key: str, path: Path, title: str) -> Path | None:
    """Output tok/s and p99 ITL against `x_key`, one line per request rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot", file=sys.stderr)
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    # Categorical x (evenly spaced, None shown as "no limit"): sweeps double their steps.
    levels = sorted({row[x_key] for row in rows}, key=lambda x: math.inf if x is None else x)
    position = {level: index for index, level in enumerate(levels)}
    rates = sorted({str(row.get("request_rate", "inf")) for row in rows})
    for rate in rates:
        mine = [row for row in rows if str(row.get("request_rate", "inf")) == rate]
        xs = [position[row[x_key]] for row in mine]
        label = f"rate {rate}" if len(rates) > 1 else None
        left.plot(xs, [row["output_throughput"] for row in mine], "o-", label=label)
        right.plot(xs, [row["p99_itl_ms"] for row in mine], "o-", label=label)
    for axis, ylabel in ((left, "output tokens/s"), (right, "p99 ITL (ms)")):
        axis.set_xticks(range(len(levels)), ["no limit" if x is None else x for x in levels])
        axis.set_xlabel(x_key.replace("_", " "))
        axis.set_ylabel(ylabel)
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        if len(rates) > 1:
            axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _plain_json(value: object) -> object:
    """NaN and inf as null and "inf", so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else None
    if isinstance(value, dict):
        return {key: _plain_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_json(item) for item in value]
    return value


def save_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain_json(payload), indent=2, allow_nan=False) + "\n")
