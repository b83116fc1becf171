"""The stop's process bookkeeping, on real processes: a grandchild orphaned by its parent's death is still ours.

Run in a fresh interpreter: ``OwnedProcesses`` makes its process a child subreaper, which should not leak into the
pytest process (other tests' orphaned Ray workers would become its zombies).
"""

import subprocess
import sys

# A parent that starts a long-sleeping grandchild, prints its pid and exits at once: the raylet ended right after it
# forked a worker, in miniature.
CHECK = r"""
import subprocess, sys, time
import psutil
from splitspec.stopping import OwnedProcesses

PARENT = "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']).pid)"

owned = OwnedProcesses()  # becomes a subreaper before anything is started
parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
grandchild = psutil.Process(int(parent.stdout.readline()))
parent.wait(timeout=30)  # the parent is gone before any snapshot saw the grandchild
try:
    assert grandchild.ppid() == psutil.Process().pid, f"not reparented to us: ppid {grandchild.ppid()}"
    assert grandchild.pid in [p.pid for p in owned.alive()], "the orphan is not among our processes"
    ended = owned.end(grace_s=5.0)
    assert any(f"({grandchild.pid})" in name for name in ended), ended
    assert not owned.alive(), "still alive after end()"
finally:
    try:
        grandchild.kill()
    except psutil.Error:
        pass
print("ok")
"""


def test_an_orphaned_grandchild_is_found_and_ended():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
