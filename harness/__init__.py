"""The harness: the real components that the test tiers, e2e/ and bench/ run against, outside
the test tree so that bench/ needs nothing from tests/ (tests/unit/test_bench_independent.py
holds it so; import-linter's contracts in pyproject.toml keep harness from importing tests).

One job per module:
- `polling`: `wait_for`, the one helper for waiting on a condition;
- `processes`: a logged child process in its own process group, free loopback ports;
- `controlplane`: where the pinned Kubernetes binaries are (`make controlplane`);
- `cluster`: a real control plane (etcd, kube-apiserver, controllers, kwok) with fake GKE
  nodes; `python -m harness.cluster` runs one by hand;
- `lws`: the real LeaderWorkerSet controller beside it;
- `operator_process`: the tpusync operator as a process, the chart installed with helm;
- `helm`: the pinned helm binary and chart rendering;
- `faultproxy`: a fault-injecting proxy in front of kube-apiserver;
- `gke_api`: a server for the documented GKE REST API (a contract server, not GKE);
- `gke_schema`: Google's published schema of that API (the container v1 discovery document);
- `fabric`: simulated hosts in network namespaces over shaped links;
- `tinymodel`: a tiny random Qwen3 checkpoint (HF transformers) for real engines;
- `engines`, `engine_proc`: vLLM engines (offline API) as processes driven over stdin/stdout;
- `tpu_engines`, `tpu_engine_proc`: the same on tpu-inference (JAX on the CPU), in the
  tpu-inference tier's interpreter;
- `llmd_indexer`: llm-d's indexer over vLLM engines; `llmd_fleet`: reference servers on real
  sidecars and llm-d's indexer over them (the llm-d tier's);
- `sglang_pools`: SGLang's real host pools and tpusync's backend as SGLang builds them;
- `sshfs`, `dns_server`, `revision_router`, `kube_expansion`, `invalid_objects`, `keys`,
  `host_devices`: the smaller pieces some tiers share.

The repository root must be on sys.path: pytest's `pythonpath` setting puts it there; scripts
(bench/) insert it themselves.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
