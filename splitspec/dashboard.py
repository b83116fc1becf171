"""The Grafana dashboard, defined as Python panels (the one source of truth of dashboards/splitspec.json).

    python -m splitspec.dashboard           # regenerate dashboards/splitspec.json
    python -m splitspec.dashboard --check   # fail if the JSON differs from these panels

Every query uses only metrics of ``deployments.metrics`` (a test checks both
ways) and ``$application`` / ``$deployment`` filters; ratios are PromQL.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "splitspec.json"
UID = "splitspec-v1"
APP = 'application=~"$application"'
RATE = "1m"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL)
    description: str = ""


def _q(quantile: float, metric: str, by: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({group}) (rate({metric}_bucket{{{APP}}}[{RATE}])))"


def _quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"p{int(q * 100)}", _q(q, metric)) for q in (0.5, 0.95, 0.99))


PANELS = [
    Panel("Requests by outcome", "reqps", (
        ("{{method}} {{outcome}}", f"sum by (method, outcome) (rate(ray_splitspec_requests_total{{{APP}}}[{RATE}]))"),
    ), "Finished requests per second: ok, or the gRPC status they got."),
    Panel("Errors by status", "reqps", (
        ("{{outcome}}", f'sum by (outcome) (rate(ray_splitspec_requests_total{{{APP}, outcome!="ok"}}[{RATE}]))'),
    )),
    Panel("Time to first token", "s", _quantiles("ray_splitspec_time_to_first_token_seconds")),
    Panel("Inter-token latency", "s", _quantiles("ray_splitspec_inter_token_latency_seconds")),
    Panel("End-to-end request latency", "s", _quantiles("ray_splitspec_request_latency_seconds")),
    Panel("Acceptance rate", "percentunit", (
        ("accepted / drafted", f"sum(rate(ray_splitspec_accepted_tokens_total{{{APP}}}[{RATE}])) / "
                               f"sum(rate(ray_splitspec_draft_tokens_total{{{APP}}}[{RATE}]))"),
    ), "Share of draft tokens the target accepted."),
    Panel("Mean acceptance length", "short", (
        ("tokens per verify step", f"(sum(rate(ray_splitspec_accepted_tokens_total{{{APP}}}[{RATE}])) + "
                                   f"sum(rate(ray_splitspec_drafted_steps_total{{{APP}}}[{RATE}]))) / "
                                   f"sum(rate(ray_splitspec_drafted_steps_total{{{APP}}}[{RATE}]))"),
    ), "Tokens emitted per target pass: accepted drafts + the recovered or bonus token (1 = no gain)."),
    Panel("Acceptance by draft position", "percentunit", (
        ("position {{position}}", f"sum by (position) (rate(ray_splitspec_accepted_tokens_by_position_total{{{APP}}}[{RATE}])) "
                                  f"/ ignoring(position) group_left sum(rate(ray_splitspec_drafted_steps_total{{{APP}}}[{RATE}]))"),
    ), "Share of drafts whose token at this position was accepted."),
    Panel("Pre-draft hit rate", "percentunit", (
        ("hits / pre-drafts", f"sum(rate(ray_splitspec_pre_draft_hits_total{{{APP}}}[{RATE}])) / "
                              f"sum(rate(ray_splitspec_pre_drafts_total{{{APP}}}[{RATE}]))"),
    ), "With overlap on: share of verify steps whose next block the drafter had ready when the verdict came."),
    Panel("Tokens generated per second", "short", (
        ("generated", f"sum(rate(ray_splitspec_generated_tokens_total{{{APP}}}[{RATE}]))"),
        ("verify steps", f"sum(rate(ray_splitspec_verify_steps_total{{{APP}}}[{RATE}]))"),
        ("prompt", f"sum(rate(ray_splitspec_prompt_tokens_total{{{APP}}}[{RATE}]))"),
    )),
    Panel("Stage step latency p50 (prefill / draft / verify)", "s", (
        ("{{stage}}", _q(0.5, "ray_splitspec_stage_latency_seconds", "stage")),
    )),
    Panel("Stage step latency p95 (prefill / draft / verify)", "s", (
        ("{{stage}}", _q(0.95, "ray_splitspec_stage_latency_seconds", "stage")),
    )),
    Panel("Accepted length per step p50 / p95", "short", (
        ("p50", _q(0.5, "ray_splitspec_accepted_length")),
        ("p95", _q(0.95, "ray_splitspec_accepted_length")),
    )),
    Panel("Batched pass size (prefill / draft / verify): calls and rows per pass", "short", (
        ("sessions p50 {{stage}}", _q(0.5, "ray_splitspec_batch_calls", "stage")),
        ("rows p50 {{stage}}", _q(0.5, "ray_splitspec_batch_rows", "stage")),
        ("rows p95 {{stage}}", _q(0.95, "ray_splitspec_batch_rows", "stage")),
    ), "How many concurrent requests' calls share one engine pass (continuous batching)."),
    Panel("Grammar mask time per verify pass p50 / p95", "s", (
        ("p50", _q(0.5, "ray_splitspec_grammar_mask_seconds")),
        ("p95", _q(0.95, "ray_splitspec_grammar_mask_seconds")),
    ), "Structured outputs: the masks of a pass's constrained sessions, computed beside the target's pass "
       "(compare with the verify stage's step latency)."),
    Panel("Prompts prefilled per second, by stage", "reqps", (
        ("{{stage}}", f"sum by (stage) (rate(ray_splitspec_prefills_total{{{APP}}}[{RATE}]))"),
    ), "prefill: a pass of the prefill stage; verify: the prefix cache held all but a few positions "
       "(limits.local_prefill_tokens) and the verify replica computed them in its batched pass."),
    Panel("KV handoff bytes/s", "Bps", (
        ("prefill -> verify", f"sum(rate(ray_splitspec_kv_handoff_bytes_total{{{APP}}}[{RATE}]))"),
    )),
    Panel("KV handoff latency (put -> resolved)", "s", _quantiles("ray_splitspec_kv_handoff_latency_seconds")[:2]),
    Panel("Open sessions per replica", "short", (
        ("{{deployment}} {{replica}}", f'sum by (deployment, replica) (ray_splitspec_open_sessions{{{APP}, deployment=~"$deployment"}})'),
    )),
    Panel("KV bytes held per replica", "bytes", (
        ("{{deployment}} {{replica}}", f'sum by (deployment, replica) (ray_splitspec_kv_bytes_held{{{APP}, deployment=~"$deployment"}})'),
    )),
    Panel("Requests without speculation", "short", (
        ("draft stage failed (fallback)", f"sum(increase(ray_splitspec_drafter_fallbacks_total{{{APP}}}[5m])) or vector(0)"),
        ("declined: {{reason}}", f"sum by (reason) (increase(ray_splitspec_speculation_declined_total{{{APP}}}[5m])) or vector(0)"),
    ), "Requests that lost speculation because the draft stage failed (they still get the target's answer), and "
       "adaptive requests served without a drafter: speculation had not paid on earlier requests (cost) or the "
       "ingress was overloaded (load)."),
    Panel("Recovered replica losses", "short", (
        ("{{stage}}", f"sum by (stage) (increase(ray_splitspec_recoveries_total{{{APP}}}[5m])) or vector(0)"),
    ), "Stage replicas that requests lost (killed, OOM, node gone) and recovered from without an error: prefill and "
       "verify calls retried or reopened on a live replica, drafting resumed on a new draft session."),
]


def queries(panels=PANELS) -> list[str]:
    return [expr for p in panels for _, expr in p.targets]


def metric_names(panels=PANELS) -> set[str]:
    """splitspec metric names (as in deployments.metrics) that the panels query."""
    names = set()
    for expr in queries(panels):
        for series in re.findall(r"ray_(splitspec_[a-z_]+)", expr):
            names.add(re.sub(r"(_total|_bucket|_sum|_count)$", "", series))
    return names


def build() -> dict:
    panels = []
    for i, panel in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": panel.title,
            "description": panel.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [
                {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                 "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                for j, (legend, expr) in enumerate(panel.targets)
            ],
        })
    variable = lambda name, metric: {  # noqa: E731
        "name": name, "label": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": f"label_values({metric}, {name})", "refId": name}, "definition": f"label_values({metric}, {name})",
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }
    return {
        "uid": UID,
        "title": "splitspec: disaggregated speculative decoding",
        "tags": ["splitspec", "ray-serve", "speculative-decoding"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "datasource", "type": "datasource", "query": "prometheus",
             "current": {"text": "Prometheus", "value": "prometheus"}},
            variable("application", "ray_splitspec_requests_total"),
            variable("deployment", "ray_splitspec_open_sessions"),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        if not DASHBOARD.is_file() or DASHBOARD.read_text() != render():
            print(f"{DASHBOARD} is stale: run `python -m splitspec.dashboard`", file=sys.stderr)
            return 1
        return 0
    DASHBOARD.write_text(render())
    print(f"wrote {DASHBOARD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
