"""`splitspec bench batching` runs each engine's calls one by one and batched on the default pair (no timing asserted)."""

from splitspec.bench import batching as bench_batching


def test_bench_batching_reports_every_call_kind(default_pair):
    report = bench_batching.run([2], repeats=1)
    assert {r["call"] for r in report["rows"]} == {"verify (1 draft token)", "eagle propose k=1", "eagle propose k=3",
                                                   "model propose k=1"}
    assert all(r["sessions"] == 2 and r["one_by_one_ms"] > 0 and r["batched_ms"] > 0 for r in report["rows"])
