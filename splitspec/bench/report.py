"""The current figures table of the README and ``docs/benchmarks.md``, rebuilt from the committed JSON (`splitspec bench report`);
a test checks the page's table against the JSON, so a figure cannot outlive its run.

Each figure names its JSON, the key path of its value in it, the date of the run and the command that reproduces it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")  # each holds the table between BEGIN and END
BEGIN, END = "<!-- figures: begin (splitspec bench report) -->", "<!-- figures: end -->"


@dataclass(frozen=True)
class Figure:
    what: str
    json: str  # relative to the repository
    path: tuple[str, ...]  # keys into the JSON
    unit: str  # "x", "tok/s", "" (a count or a flag)
    date: str
    command: str

    def value(self):
        data = json.loads((ROOT / self.json).read_text())
        for key in self.path:
            data = data[key]
        return data

    def shown(self) -> str:
        value = self.value()
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list):
            return str(len(value))
        if isinstance(value, int):
            return f"{value:,} {self.unit}".strip()
        return f"{value:.2f}{self.unit}" if self.unit == "x" else f"{value:g} {self.unit}".strip()


SPECBENCH = "docs/bench/specbench/check-full.json"
GRPC_POLICIES = "'off,server default,eagle adaptive sequential,hybrid k=3'"
SPECBENCH_GRPC = "docs/bench/specbench/grpc-hybrid-default-12x48.json"
SPECBENCH_GRPC_RUN = f"splitspec bench grpc --prompt-set specbench --prompts 12 --max-new-tokens 48 --policies {GRPC_POLICIES}"
HELD_OUT_GRPC = "docs/bench/grpc-hybrid-default-heldout-8x64.json"
HELD_OUT_GRPC_RUN = f"splitspec bench grpc --prompts 8 --max-new-tokens 64 --policies {GRPC_POLICIES}"
LOAD = "docs/bench/bench-load.json"
SOAK = "docs/bench/soak.json"
ENGINE = "docs/bench/bench-engine.json"
LAYOUTS = "docs/bench/layouts/grpc.json"
LAYOUTS_RUN = ("splitspec bench grpc --layouts colocated,disaggregated --timeline --prompts 8 --max-new-tokens 96 "
               "--policies 'server default,eagle k=1,eagle k=2,eagle adaptive sequential'")
HEAD = "services/models/eagle_weights/eagle-final.json"  # the shipped head's report (splitspec drafter train)
HEAD_DATE = "2026-12-07"
HEAD_RUN = "splitspec drafter train --data data/drafter/default --variants final (in stages: the JSON's recipe)"
STRUCTURED = "docs/bench/structured/openai-50-closed.json"
STRUCTURED_RUN = "splitspec bench structured --schemas 50"
LAYOUTS_LOAD = "docs/bench/layouts/load.json"
LAYOUTS_LOAD_RUN = ("splitspec bench load --layouts colocated,disaggregated --concurrency 1,8 --prompts 8 "
                    "--max-new-tokens 64 --policies 'off,server default'")
FIGURES = [
    Figure("Spec-Bench, 480 first turns: server default vs speculation off, errors", SPECBENCH, ("errors",), "",
           "2026-12-06", "splitspec bench grpc --prompt-set specbench --check --prompts 0"),
    Figure("Spec-Bench, 480 first turns: greedy answers identical to speculation off", SPECBENCH,
           ("greedy_identical",), "", "2026-12-06", "splitspec bench grpc --prompt-set specbench --check --prompts 0"),
    Figure("Spec-Bench, 12 first turns x 48 tokens, single stream: server default (hybrid) / speculation off",
           SPECBENCH_GRPC, ("policies", "server default", "ratio_vs_off"), "x", "2026-12-07", SPECBENCH_GRPC_RUN),
    Figure("the same: mean accepted length, server default", SPECBENCH_GRPC,
           ("policies", "server default", "mean_accepted_length"), "", "2026-12-07", SPECBENCH_GRPC_RUN),
    Figure("the same: the EAGLE head alone, adaptive (the earlier default) / speculation off", SPECBENCH_GRPC,
           ("policies", "eagle adaptive sequential", "ratio_vs_off"), "x", "2026-12-07", SPECBENCH_GRPC_RUN),
    Figure("the shipped EAGLE head, its run's report: Spec-Bench (48 first turns), k = 3 mean accepted length", HEAD,
           ("variants", "final", "acceptance", "specbench", "k3", "mean_accepted_length"), "", HEAD_DATE, HEAD_RUN),
    Figure("the same, held-out prompts", HEAD, ("variants", "final", "acceptance", "held_out", "k3",
                                                "mean_accepted_length"), "", HEAD_DATE, HEAD_RUN),
    Figure("the same: answer tokens it was trained on", HEAD, ("answer_tokens",), "", HEAD_DATE, HEAD_RUN),
    Figure("held-out prompts, 8 x 64 tokens, single stream: server default (hybrid) / speculation off", HELD_OUT_GRPC,
           ("policies", "server default", "ratio_vs_off"), "x", "2026-12-07", HELD_OUT_GRPC_RUN),
    Figure("the same: the EAGLE head alone, adaptive / speculation off", HELD_OUT_GRPC,
           ("policies", "eagle adaptive sequential", "ratio_vs_off"), "x", "2026-12-07", HELD_OUT_GRPC_RUN),
    Figure("held-out prompts, single stream: speculation off", HELD_OUT_GRPC, ("policies", "off", "tok_s"), "tok/s",
           "2026-12-07", HELD_OUT_GRPC_RUN),
    Figure("held-out prompts, verify alone on a core, the verify replica drafting: server default / speculation off",
           LAYOUTS, ("layouts", "colocated", "policies", "server default", "ratio_vs_off"), "x", "2026-12-06", LAYOUTS_RUN),
    Figure("the same, the draft stage drafting on the other core: server default / the verify replica drafting",
           LAYOUTS, ("vs_colocated", "disaggregated", "server default"), "x", "2026-12-06", LAYOUTS_RUN),
    Figure("8 streams, the same two layouts: the draft stage drafting / the verify replica drafting, server default",
           LAYOUTS_LOAD, ("vs_colocated", "disaggregated", "server default", "8"), "x", "2026-12-06", LAYOUTS_LOAD_RUN),
    Figure("in-process, best EAGLE k / splitspec speculation off", ENGINE, ("speedup_vs_splitspec_off",), "x", "2026-12-06",
           "splitspec bench engine --ks 1,2,3"),
    Figure("in-process, best EAGLE k", ENGINE, ("splitspec_tok_s",), "tok/s", "2026-12-06",
           "splitspec bench engine --ks 1,2,3"),
    Figure("in-process, the target alone (transformers generate)", ENGINE, ("target_tok_s",), "tok/s", "2026-12-06",
           "splitspec bench engine --ks 1,2,3"),
    Figure("8 streams: throughput / 1 stream, speculation off", LOAD,
           ("closed_loop", "off", "8", "throughput_vs_first"), "x", "2026-12-04", "splitspec bench load"),
    Figure("32 streams: throughput / 1 stream, speculation off", LOAD,
           ("closed_loop", "off", "32", "throughput_vs_first"), "x", "2026-12-04", "splitspec bench load"),
    Figure("soak, 500 requests at 32 at once: nothing leaked", SOAK, ("ok",), "", "2026-12-06", "splitspec soak"),
    Figure("structured outputs, 50 held-out schemas, the openai client: valid answers, server default", STRUCTURED,
           ("valid", "server default"), "", "2026-12-07", STRUCTURED_RUN),
    Figure("the same: answers identical to speculation off", STRUCTURED, ("identical",), "", "2026-12-07",
           STRUCTURED_RUN),
    Figure("the same: server default / speculation off", STRUCTURED, ("speedup_server_default",), "x", "2026-12-07",
           STRUCTURED_RUN),
    Figure("the same schemas through gRPC: server default / speculation off", STRUCTURED,
           ("grpc", "speedup_server_default"), "x", "2026-12-07", STRUCTURED_RUN),
]


def table(page: Path = PAGES[0], figures: list[Figure] = FIGURES) -> str:
    """The figures as a markdown table, their JSON linked relative to ``page``."""
    rows = ["| figure | value | date | command | JSON |", "| --- | ---: | --- | --- | --- |"]
    for f in figures:
        link = f"[{Path(f.json).name}]({Path(os.path.relpath(ROOT / f.json, page.parent)).as_posix()})"
        rows.append(f"| {f.what} | {f.shown()} | {f.date} | `{f.command}` | {link} |")
    return "\n".join(rows) + "\n"


def page_table(page: Path) -> str:
    text = page.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n") + "\n"


def current() -> bool:
    return all(page_table(page) == table(page) for page in PAGES)


def write() -> tuple[Path, ...]:
    for page in PAGES:
        text = page.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        page.write_text(text[:start] + "\n" + table(page) + text[end:])
    return PAGES
