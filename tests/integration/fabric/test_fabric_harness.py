"""The fabric harness itself: isolated addresses, and nothing left behind after a crash."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import REPO as ROOT
from harness import fabric as fab
from harness.polling import wait_for

CRASHING = """
import time
from harness import fabric
f = fabric.Fabric(2)
f.start()
sleeper = f.hosts[0].popen(["sleep", "600"])
print(f.name, sleeper.pid, flush=True)
time.sleep(600)
"""


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()


def test_addresses_exist_only_inside_the_fabric(make_fabric):
    f = make_fabric(2)
    root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert fab.SUBNET not in root
    for h in f.hosts:
        routes = h.run(["ip", "route"]).stdout.strip().splitlines()
        assert routes == [f"{fab.SUBNET}.0/24 dev eth0 proto kernel scope link src {h.ip}"], routes


def test_a_crashed_harness_is_cleaned_up_by_the_next_one(make_fabric):
    """A harness killed with SIGKILL leaves its namespaces, a process in one and its work
    directory; the next Fabric's start removes them (and leaves other live fabrics alone)."""
    proc = subprocess.Popen([sys.executable, "-c", CRASHING], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)  # python -c: the working directory is on sys.path
    name, sleeper = proc.stdout.readline().split()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    stale = [n for n in namespaces() if n.startswith(name)]
    assert len(stale) == 3 and os.path.exists(f"/proc/{sleeper}")   # two hosts and the switch, and its process
    assert os.path.isdir(os.path.join(fab.WORK_ROOT, name))
    live = make_fabric(1)
    assert not [n for n in namespaces() if n.startswith(name)]
    assert not os.path.exists(os.path.join(fab.WORK_ROOT, name))
    wait_for("the stale process to die", lambda: not os.path.exists(f"/proc/{sleeper}") or _zombie(sleeper), 10,
             interval=0.02)
    assert live.hosts[0].ns in namespaces()


def _zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
