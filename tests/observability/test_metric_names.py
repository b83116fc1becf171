"""Every metric the dashboard queries is defined in deployments.metrics, and every defined metric is on the dashboard."""

import json

from deployments.metrics import BUCKETS, METRICS
from splitspec import dashboard


def test_dashboard_and_metrics_module_agree():
    assert dashboard.metric_names() == set(METRICS)


def test_checked_in_json_is_generated_from_the_panels():
    assert dashboard.DASHBOARD.read_text() == dashboard.render()


def test_dashboard_shape():
    board = json.loads(dashboard.DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"application", "deployment"} <= set(variables)
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert "$application" in target["expr"] or "vector(0)" in target["expr"]


def test_counters_histograms_gauges_only_where_they_belong():
    """Ratios are PromQL, not exported gauges: the only gauges are per-replica levels."""
    gauges = {name for name, (kind, _, _) in METRICS.items() if kind == "gauge"}
    assert gauges == {"splitspec_open_sessions", "splitspec_kv_bytes_held"}
    for name, (kind, description, _) in METRICS.items():
        assert description.endswith(".")
        # histograms: latencies (seconds) and sizes with their own buckets (accepted length, batch size)
        assert (kind == "histogram") == (name.endswith("_seconds") or name in BUCKETS)
