"""placement.cpus: a replica's process runs on its CPU set, every thread of it, those started later too; CPUs the
node does not offer are refused with the reason; the config checks the ids."""

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig

CHILD = """
import os, threading
from deployments.placement import pin_cpus
before = threading.Thread(target=lambda: __import__("time").sleep(2)); before.start()
pin_cpus([{cpu}], "verify")
after = []
t = threading.Thread(target=lambda: after.append(os.sched_getaffinity(0))); t.start(); t.join()
sets = {{tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}}
print(sorted(set(map(tuple, map(sorted, sets.values())))), sorted(after[0]), len(sets))
"""


def test_every_thread_runs_on_the_cpu_set():
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", CHILD.format(cpu=cpu)], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out[0] == f"[({cpu},)]" and out[1] == f"[{cpu}]", out  # threads started before and after alike
    assert int(out[2]) >= 2


def test_cpus_the_node_does_not_offer_are_refused():
    from deployments.placement import CpuSetError, pin_cpus

    missing = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(CpuSetError, match=f"placement.cpus \\[{missing}\\] are not all CPUs of this node"):
        pin_cpus([missing], "verify")
    pin_cpus([], "verify")  # empty: nothing changes
    assert os.sched_getaffinity(0)


def test_the_config_checks_the_ids():
    config = AppConfig.model_validate({"stages": {"verify": {"placement": {"cpus": [1]}}},
                                       "ingress_placement": {"cpus": [0]}})
    assert config.stages.verify.placement.cpus == [1] and config.placement("ingress").cpus == [0]
    for bad in ([1, 1], [-1]):
        with pytest.raises(ValidationError, match="distinct CPU ids"):
            AppConfig.model_validate({"stages": {"draft": {"placement": {"cpus": bad}}}})


def test_a_local_cluster_pins_a_stage_that_names_only_cpus():
    from splitspec.cluster import placements_for

    config = AppConfig.model_validate({"stages": {"verify": {"placement": {"cpus": [0]}}}})
    for nodes in (1, 3):
        placed = placements_for(nodes, config).stages.verify.placement
        assert placed.cpus == [0] and (placed.resources or placed.label_selector), placed
