"""Test support: what the test tiers, e2e/ and bench/ share (imported as `tests.support`).

One job per module:
- `polling`: `wait_for`, the one helper for waiting on a condition;
- `processes`: a logged child process in its own process group, free loopback ports;
- `controlplane`: where the pinned Kubernetes binaries are (`make controlplane`);
- `cluster`: a real control plane (etcd, kube-apiserver, controllers, kwok) with fake GKE
  nodes; `python -m tests.support.cluster` runs one by hand;
- `lws`: the real LeaderWorkerSet controller beside it;
- `operator_process`: the tpusync operator as a process, the chart installed with helm;
- `helm`: the pinned helm binary and chart rendering;
- `faultproxy`: a fault-injecting proxy in front of kube-apiserver;
- `gke_api`: a server for the documented GKE REST API (a contract server, not GKE);
- `gke_schema`: Google's published schema of that API (the container v1 discovery document);
- `fabric`: simulated hosts in network namespaces over shaped links.

The repository root must be on sys.path: pytest's `pythonpath` setting puts it there; scripts
(bench/) insert it themselves.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
