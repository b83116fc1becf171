"""Render the dashboard's main panels from Prometheus' query_range API into a PNG (no Grafana needed).

    splitspec dashboard snapshot --prometheus http://127.0.0.1:9090 --minutes 15 --out snapshot.png
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request
from pathlib import Path

from splitspec.dashboard import PANELS

MAIN_PANELS = (
    "Acceptance rate",
    "Mean acceptance length",
    "Acceptance by draft position",
    "Tokens generated per second",
    "Time to first token",
    "Inter-token latency",
    "Stage step latency p50 (prefill / draft / verify)",
    "KV handoff latency (put -> resolved)",
    "Requests by outcome",
)
ALL = ".*"  # what Grafana's "All" substitutes for $application / $deployment


def substitute(expr: str) -> str:
    return expr.replace("$application", ALL).replace("$deployment", ALL)


def query(prometheus: str, expr: str, *, at: float | None = None) -> list[dict]:
    """Instant query; returns Prometheus' result list."""
    params = {"query": substitute(expr)}
    if at is not None:
        params["time"] = f"{at:.3f}"
    return _get(prometheus, "/api/v1/query", params)["result"]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = {"query": substitute(expr), "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    return _get(prometheus, "/api/v1/query_range", params)["result"]


def _get(prometheus: str, path: str, params: dict) -> dict:
    url = f"{prometheus.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus query failed: {body}")
    return body["data"]


def _legend(template: str, labels: dict) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(prometheus: str, out: Path, *, minutes: float = 15.0, step: float = 5.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time()
    start = end - minutes * 60
    panels = [p for p in PANELS if p.title in MAIN_PANELS]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for legend, expr in panel.targets:
            for series in query_range(prometheus, expr, start, end, step):
                points = [(float(t) - end, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    xs, ys = zip(*points)
                    ax.plot([x / 60 for x in xs], ys, label=_legend(legend, series["metric"]))
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("minutes ago")
        ax.set_ylabel(panel.unit)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"splitspec — last {minutes:g} minutes ({prometheus})")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
