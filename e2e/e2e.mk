# End-to-end targets (control plane build, e2e): included by the top-level Makefile.
# The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, helm,
# kubectl, kwok stages, third-party CRDs) is built from e2e/versions.env into
# ~/.cache/tpusync/controlplane/<key>/ by e2e/build-controlplane.sh; see docs/e2e.md.

E2E_BUILD := e2e/build-controlplane.sh
# Lazily evaluated: only targets that use it pay for the hashing.
CONTROLPLANE_DIR = $(shell bash $(E2E_BUILD) --print)
CONTROLPLANE_BIN = $(CONTROLPLANE_DIR)/bin

.PHONY: controlplane controlplane-dir controlplane-bin controlplane-regen e2e e2e-cluster lws nodes cluster-test \
	cluster-tier cluster-tiers cluster

# Builds the control plane if the cache lacks it (no-op, about a second, when present).
# The Go builds run under nice so they yield to anything else on the machine.
controlplane:
	nice -n 19 bash $(E2E_BUILD)

controlplane-dir:
	@echo $(CONTROLPLANE_DIR)

# Prints the directory holding etcd, kube-apiserver, ..., kwok, helm, kubectl.
controlplane-bin:
	@echo $(CONTROLPLANE_BIN)

# After bumping KUBERNETES_VERSION or ETCD_VERSION in e2e/versions.env: regenerate the wrapper
# modules' go.mod/go.sum, then commit them.
controlplane-regen:
	bash e2e/controlplane/regen-gomod.sh

e2e: controlplane lws install
	TPUSYNC_CONTROLPLANE_DIR=$(CONTROLPLANE_DIR) TPUSYNC_LWS_DIR=$(shell bash e2e/build-lws.sh --print) \
		$(PY) -m pytest e2e -q

# The LeaderWorkerSet controller (its own cache key: the control plane's does not change).
lws:
	nice -n 19 bash e2e/build-lws.sh

# Starts a cluster with fake TPU node pools for manual poking; Ctrl-C tears it down.
e2e-cluster: controlplane install
	TPUSYNC_CONTROLPLANE_DIR=$(CONTROLPLANE_DIR) $(PY) -m harness.cluster

# The real-node tier (harness/nodes.py, tests/cluster): containerd, runc, CoreDNS and the pause
# program, built from e2e/versions.env into ~/.cache/tpusync/nodes/<key>/ (kubelet and kube-proxy
# come with the control plane's build).
nodes: node-deps
	nice -n 19 bash e2e/build-nodes.sh

# The user's first day on real nodes: the release pushed to the nodes' registry, helm install,
# a pool and a serving whose pods are real containers, requests served through them.
# cluster-test builds the image archives first; cluster-tier runs on those already built.
cluster-test: image-archives
	$(MAKE) cluster-tier

cluster-tier: controlplane lws nodes llmd-indexer install
	TPUSYNC_CONTROLPLANE_DIR=$(CONTROLPLANE_DIR) TPUSYNC_IMAGES=$(IMAGE_OUT) \
	  TPUSYNC_LWS_DIR=$(shell bash e2e/build-lws.sh --print) \
	  TPUSYNC_LLMD_INDEXER=$$(bash tests/llmd/build-indexer.sh --print) $(PY) -m pytest -q -p no:cacheprovider tests/cluster

# make test's last step: the e2e suite and the real-node tier side by side (both mostly wait on
# control planes, kubelets and engines: 11.5 min together, measured, against 16 one after the
# other; their addresses never meet: 127.0.0.1 and the nodes' own namespaces).
cluster-tiers: controlplane lws nodes llmd-indexer install
	$(MAKE) -j2 --output-sync=target e2e cluster-tier

# The same cluster by hand (four TPU nodes, LWS, the registry empty): Ctrl-C tears it down.
cluster: controlplane lws nodes install
	TPUSYNC_CONTROLPLANE_DIR=$(CONTROLPLANE_DIR) TPUSYNC_LWS_DIR=$(shell bash e2e/build-lws.sh --print) \
	  $(PY) -m harness.nodes
