"""A real Prometheus scrapes the running service through Ray's discovery file; every dashboard query returns data."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from splitspec import dashboard, snapshot
from tests.serving.conftest import free_port, make_config, serving

pytestmark = pytest.mark.slow

SCRAPE_CONFIG = Path(dashboard.__file__).resolve().parent.parent / "dashboards" / "prometheus.yml"
SCHEMA = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
LOAD = [  # (policy, stream?)
    (dict(drafter="model", num_draft_tokens=3), False),
    (dict(drafter="model", num_draft_tokens=3), True),
    (dict(drafter="model", num_draft_tokens=1), False),
    (dict(drafter="prompt_lookup", num_draft_tokens=3), True),
    (dict(speculate=False), False),
    (dict(drafter="model", num_draft_tokens=2), True),
    (dict(drafter="eagle", num_draft_tokens=1, overlap=True), True),  # pre-drafting: the hit-rate panel
    (dict(drafter="model", num_draft_tokens=3, json_schema=SCHEMA), False),  # structured output: the grammar panel
]
PROMPTS = ["Count from 1 to 10.", "List three primary colors.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is not installed: scripts/setup.sh installs Debian's `prometheus` package"
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] = "1s"
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError((tmp / "prometheus.log").read_text()[-2000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def loaded(prometheus):
    """Serve, send a bounded load (good and bad requests), wait until Prometheus has scraped it all."""
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    try:
        # (the remote layout: pre-drafting for the hit-rate panel, and the draft stage's own panels)
        with serving(make_config(speculation={"drafting": "remote"}), dashboard=True) as client:  # (the dashboard writes the discovery file)
            sent = 0
            for i, (policy, stream) in enumerate(LOAD):
                messages = [("user", PROMPTS[i % len(PROMPTS)])]
                if stream:
                    sent += sum(len(c.token_ids) for c in client.stream(messages=messages, max_new_tokens=24, **policy))
                else:
                    sent += len(client.generate(messages=messages, max_new_tokens=24, **policy).token_ids)
            for bad in (dict(prompt=""), dict(prompt="hi", temperature=-1.0)):
                with pytest.raises(grpc.RpcError):
                    client.generate(**bad)
            deadline = time.monotonic() + 120
            while True:
                got = snapshot.query(prometheus, "sum(ray_splitspec_generated_tokens_total)")
                if got and float(got[0]["value"][1]) >= sent:
                    break
                assert time.monotonic() < deadline, f"Prometheus saw {got} generated tokens, the client {sent}"
                time.sleep(1)
            while True:  # every dashboard query has its data (a rate() needs two scrapes of its series)
                empty = [expr for panel in dashboard.PANELS for _, expr in panel.targets if not snapshot.query(prometheus, expr)]
                if not empty:
                    break
                if time.monotonic() >= deadline:  # (test_every_dashboard_query_returns_data names them)
                    break
                time.sleep(1)
            yield prometheus, sent
    finally:
        os.environ.pop("RAY_metrics_report_interval_ms", None)


def test_every_dashboard_query_returns_data(loaded):
    url, _ = loaded
    empty = [(panel.title, expr) for panel in dashboard.PANELS for _, expr in panel.targets if not snapshot.query(url, expr)]
    assert not empty, f"dashboard queries without data: {empty}"


def test_values_match_what_the_client_saw(loaded):
    url, sent = loaded
    value = lambda expr: float(snapshot.query(url, expr)[0]["value"][1])  # noqa: E731
    assert value("sum(ray_splitspec_generated_tokens_total)") == sent
    drafted, accepted = value("sum(ray_splitspec_draft_tokens_total)"), value("sum(ray_splitspec_accepted_tokens_total)")
    assert 0 < drafted and 0 <= accepted <= drafted
    assert value('sum(ray_splitspec_requests_total{outcome="ok"})') == len(LOAD)
    assert value('sum(ray_splitspec_requests_total{outcome="INVALID_ARGUMENT"})') == 2
    assert value("sum(ray_splitspec_prefills_total)") == len(LOAD)  # one prefill a request, on either stage
    assert 0 <= value("sum(ray_splitspec_pre_draft_hits_total)") <= value("sum(ray_splitspec_pre_drafts_total)") > 0
    acceptance = next(p for p in dashboard.PANELS if p.title == "Acceptance rate").targets[0][1]
    length = next(p for p in dashboard.PANELS if p.title == "Mean acceptance length").targets[0][1]
    # the panels' rates over their window agree with the totals (the whole load ran within the window)
    assert value(acceptance) == pytest.approx(accepted / drafted, abs=0.1)
    steps = value("sum(ray_splitspec_drafted_steps_total)")
    assert value(length) == pytest.approx((accepted + steps) / steps, abs=0.2) and value(length) >= 1


def test_snapshot_png(loaded, tmp_path):
    url, _ = loaded
    out = snapshot.render(url, tmp_path / "snapshot.png", minutes=5, step=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
