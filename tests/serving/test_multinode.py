"""`--nodes 3`: each stage runs on the node labelled for it, the KV crosses nodes by reference, the ingress never holds it."""

import os
import subprocess
import sys

import pytest
import ray
from ray import serve
from ray.util.state import list_actors

from deployments.config import STAGE_LABEL
from splitspec.cluster import store_stats
from tests.serving.conftest import BOUND_S, PROMPTS, make_config, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with serving(make_config(), nodes=3, dashboard=True) as client:  # the state API needs the dashboard
        yield client


def test_stages_run_on_their_labelled_nodes(client):
    labels = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n["Alive"]}
    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    seen = {}
    for stage, deployment in (("prefill", "Prefill"), ("draft", "Draft"), ("verify", "Verify")):
        nodes = [a.node_id for a in actors if a.class_name == f"ServeReplica:splitspec:{deployment}"]
        assert nodes, f"no running replica of {deployment}"
        for node in nodes:
            assert labels[node].get(STAGE_LABEL) == stage
        seen[stage] = set(nodes)
    assert len(set.union(*seen.values())) == 3  # three different nodes


def test_kv_crosses_nodes_by_reference(client, reference):
    (ingress_node,) = {a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                       if a.class_name == "ServeReplica:splitspec:SpecDecodeIngress"}
    created_before = store_stats(ingress_node).cumulative_created_bytes
    for prompt in PROMPTS[:3]:
        response = client.generate(messages=[("user", prompt)], max_new_tokens=16)
        assert list(response.token_ids) == reference(prompt)[:16]
        assert response.timings.kv_handoff_ms > 0
    handoffs = serve.get_app_handle("splitspec").recent_handoffs.remote().result()
    assert len(handoffs) >= 3
    for h in handoffs:
        assert h["prefill_node"] != h["verify_node"]  # resolved by the verifier on another node
        assert h["resolved_bytes"] == h["kv_bytes"] > 0
        assert ingress_node not in (h["prefill_node"], h["verify_node"])
    # the ingress passed references on, never the bytes: had it resolved one KV, its node's object store would have
    # created a copy of it (objects this large always go through the store)
    created = store_stats(ingress_node).cumulative_created_bytes - created_before
    assert created < min(h["kv_bytes"] for h in handoffs), created




@pytest.mark.parametrize("start", ["splitspec.cluster.LocalCluster(dashboard=False).start()", "splitspec.drafter.connect(None)"],
                         ids=["serve", "drafter train"])
def test_a_local_cluster_started_beside_it_is_its_own(client, start):
    """This 3-node cluster is the one /tmp/ray/ray_current_cluster names: `splitspec serve` and `splitspec drafter
    train` started beside it without --address start a cluster of their own (joining it, Ray refused their CPU counts)."""
    code = (f"import ray, splitspec.cluster, splitspec.drafter; {start}; "
            "print(ray.get_runtime_context().gcs_address); ray.shutdown()")
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] != ray.get_runtime_context().gcs_address
