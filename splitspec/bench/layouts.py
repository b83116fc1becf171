"""The serving layouts side by side (``splitspec bench grpc --layouts colocated,disaggregated``).

Both pin the verify replica alone to the machine's last CPU, and every other
replica to the others (placement.cpus): on a CPU box that is what "a device
of its own" means. In ``colocated`` the verify replica drafts itself
(speculation.drafting local); in ``disaggregated`` the draft stage drafts on
the other CPUs, asked by the verify replica directly, and pre-drafts the next
block while this one is verified (drafting remote). Each layout runs on a
local cluster of its own, one after the other, with the same prompts and
policies; speculation off is the target alone on the verify CPU in each.

``timeline``: one request's loop as its verify replica recorded it
(``Verify.recent_timelines``): per round, the verify pass, the proposal as
the loop waited for it, the drafter's own pass within it, and the hop (the
rest of a remote proposal).
"""

from __future__ import annotations

import os

from deployments.config import AppConfig

LAYOUTS = ("colocated", "disaggregated")


def layout_config(config: AppConfig, layout: str) -> AppConfig:
    """``config`` laid out as ``layout``: verify alone on the last CPU, the other stages and the ingress on the rest."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {list(LAYOUTS)}")
    cpus = sorted(os.sched_getaffinity(0))
    verify, rest = cpus[-1:], cpus[:-1] or cpus
    data = config.model_dump()
    for stage in ("prefill", "draft"):
        data["stages"][stage]["placement"]["cpus"] = rest
    data["stages"]["verify"]["placement"]["cpus"] = verify
    data["ingress_placement"]["cpus"] = rest
    data["speculation"]["drafting"] = "local" if layout == "colocated" else "remote"
    return AppConfig.model_validate(data)


def compare(reports: dict[str, dict], base: str = "colocated") -> dict[str, dict[str, float]]:
    """Per layout, each policy's tok/s against the same policy in ``base``'s layout (from their runs)."""
    if base not in reports:
        return {}
    ref = reports[base]["policies"]
    return {layout: {name: round(r["tok_s"] / ref[name]["tok_s"], 3) for name, r in report["policies"].items()
                     if name in ref and ref[name]["tok_s"]} for layout, report in reports.items()}


def summarize(timeline: dict) -> dict:
    """Means over a loop's rounds (ms): round, verify, propose, draft and hop; how many rounds overlapped."""
    rounds = timeline["rounds"]
    if not rounds:
        return {"rounds": 0}
    mean = lambda key: round(sum(r[key] for r in rounds) / len(rounds), 2)  # noqa: E731
    drafting = [r for r in rounds if r["propose_ms"]]
    hop = [r["propose_ms"] - r["draft_ms"] for r in drafting if not r["chained"]]
    return {"rounds": len(rounds), "round_ms": mean("ms"), "verify_ms": mean("verify_ms"),
            "propose_ms": round(sum(r["propose_ms"] for r in drafting) / len(drafting), 2) if drafting else 0.0,
            "draft_ms": round(sum(r["draft_ms"] for r in drafting) / len(drafting), 2) if drafting else 0.0,
            "hop_ms": round(sum(hop) / len(hop), 2) if hop else 0.0,
            "overlapped": sum(r["overlap"] for r in rounds), "drafted": sum(r["drafted"] for r in rounds),
            "accepted": sum(r["accepted"] for r in rounds)}


def format_timeline(timeline: dict, limit: int = 12) -> str:
    """The first ``limit`` rounds as a table, then the means."""
    lines = [f"  {'round':>5} {'at ms':>8} {'ms':>7} {'verify':>7} {'propose':>8} {'draft':>6} {'hop':>6}  "
             f"{'drafted':>7} {'acc':>3}  how"]
    for i, r in enumerate(timeline["rounds"][:limit]):
        how = "chained" if r["chained"] else "overlap" if r["overlap"] else "sequential" if r["propose_ms"] else "verify"
        hop = r["propose_ms"] - r["draft_ms"] if r["propose_ms"] and not r["chained"] else 0.0
        lines.append(f"  {i:>5} {r['at_ms']:>8.1f} {r['ms']:>7.1f} {r['verify_ms']:>7.1f} {r['propose_ms']:>8.1f} "
                     f"{r['draft_ms']:>6.1f} {hop:>6.1f}  {r['drafted']:>7} {r['accepted']:>3}  {how}")
    s = summarize(timeline)
    if s["rounds"]:
        lines.append(f"  mean of {s['rounds']} rounds: {s['round_ms']} ms a round, verify {s['verify_ms']}, propose "
                     f"{s['propose_ms']} (draft {s['draft_ms']}, hop {s['hop_ms']}); {s['overlapped']} overlapped; "
                     f"{s['accepted']}/{s['drafted']} drafts accepted")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Grouped bars: tok/s per policy, one bar per layout, each labelled with its ratio to colocated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(report["layouts"])
    policies = [name for name in report["layouts"][layouts[0]]["policies"]]
    width = 0.8 / len(layouts)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(policies)), 4))
    for i, layout in enumerate(layouts):
        xs = [j + i * width for j in range(len(policies))]
        tok_s = [report["layouts"][layout]["policies"].get(p, {}).get("tok_s", 0) for p in policies]
        bars = ax.bar(xs, tok_s, width, label=layout)
        for bar, p in zip(bars, policies):
            ratio = report["vs_colocated"].get(layout, {}).get(p)
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8)
    ax.set_xticks([j + width * (len(layouts) - 1) / 2 for j in range(len(policies))], policies, rotation=20, ha="right")
    ax.set_ylabel("tok/s (greedy, single stream)")
    ax.set_title("serving layouts (ratio: against the same policy colocated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def plot_load(report: dict, path: str) -> None:
    """``bench load --layouts``: output tok/s per policy and concurrency, one bar per layout, each labelled with its
    ratio to colocated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(report["layouts"])
    first = report["layouts"][layouts[0]]["closed_loop"]
    groups = [(policy, c) for policy, rows in first.items() for c in rows]
    width = 0.8 / len(layouts)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups)), 4))
    for i, layout in enumerate(layouts):
        rows = report["layouts"][layout]["closed_loop"]
        xs = [j + i * width for j in range(len(groups))]
        tok_s = [rows.get(p, {}).get(c, {}).get("output_throughput_tok_s", 0) for p, c in groups]
        bars = ax.bar(xs, tok_s, width, label=layout)
        for bar, (p, c) in zip(bars, groups):
            ratio = report["vs_colocated"].get(layout, {}).get(p, {}).get(c)
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8)
    ax.set_xticks([j + width * (len(layouts) - 1) / 2 for j in range(len(groups))],
                  [f"{p}\n{c} stream{'s' if c != '1' else ''}" for p, c in groups])
    ax.set_ylabel("output tok/s (greedy)")
    ax.set_title("layouts under load (ratio: vs the same policy and load, colocated)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
