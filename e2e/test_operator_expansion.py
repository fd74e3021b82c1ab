"""Spec strings reach engine command lines as written, on the real control plane: a model
name `$(HF_TOKEN)` is refused by the schema, and extra args and env values `$(HF_TOKEN)`, with
`spec.model.tokenSecretRef` naming a Secret of the namespace, cannot carry that Secret's value.

kwok plays the kubelets here and starts no container, so nothing in this harness performs
the kubelet's `$(VAR)` expansion. The test reads what the API server stores -- the Pod the
real kube-controller-manager made from the operator's Deployment -- and applies the
kubelet's own rule to it (harness/kube_expansion.py: a port of k8s.io/kubernetes
third_party/forked/golang/expansion, which pkg/kubelet/container/helpers.go
ExpandContainerCommandAndArgs applies to command and args, and pkg/kubelet/kubelet_pods.go to
env values; `$$` is one `$`, `$(NAME)` a defined variable's value), with the Secret's real
value resolved through the API.
"""

from __future__ import annotations

import base64
import json
import uuid

from test_operator import API, NONROOT_ENGINE, apply, container, get, items, pool_obj

from harness.kube_expansion import command_line, environment
from harness.polling import wait_for

POOL = "xp"
SERVING = "xs"
LEAK = "$(HF_TOKEN)"


def test_the_served_model_name_cannot_pick_up_a_secret(cluster, operator, module_namespace):
    ns = module_namespace
    secret_value = f"hf_secret-{uuid.uuid4().hex}"
    cluster.kubectl("create", "secret", "generic", "someone-elses-token", "-n", ns,
                    f"--from-literal=token={secret_value}")
    apply(cluster, pool_obj(ns, POOL, tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=1))
    serving = {"apiVersion": API, "kind": "DisaggregatedServing", "metadata": {"name": SERVING, "namespace": ns},
               "spec": {"model": {"name": LEAK, "uri": "hf://org/m",
                                  "tokenSecretRef": {"name": "someone-elses-token"}},
                        "engine": {"type": "reference", "env": [{"name": "MINE", "value": LEAK}],
                                   "securityContext": NONROOT_ENGINE},   # the restricted namespace
                        "poolRef": {"name": POOL},
                        "prefill": {"replicas": 1, "args": [f"--extra={LEAK}"]}, "decode": {"replicas": 0},
                        "routing": {"enabled": False}}}
    refused = cluster.kubectl("apply", "-f", "-", input=json.dumps(serving), check=False)
    assert refused.returncode != 0 and "spec.model.name" in refused.stderr, refused.stderr
    serving["spec"]["model"]["name"] = "org/m"
    apply(cluster, serving)

    # The Pod as the API server stores it, made by the controller-manager from the Deployment.
    pods = wait_for("the prefill pod", lambda: items(
        cluster, "pods", ns, f"tpusync.dev/serving={SERVING},tpusync.dev/role=prefill"), 90)
    pod = pods[0]
    engine = container(pod["spec"], "engine")
    secret = get(cluster, "secret", ns, "someone-elses-token")

    def value_from(ref):
        if "secretKeyRef" in ref:
            key = ref["secretKeyRef"]
            assert key["name"] == "someone-elses-token"
            return base64.b64decode(secret["data"][key["key"]]).decode()
        path = ref["fieldRef"]["fieldPath"]
        return {"metadata.name": pod["metadata"]["name"], "metadata.namespace": ns,
                "status.podIP": pod["status"].get("podIP", "")}[path]

    env = environment(engine, value_from)
    argv = command_line(engine, env)
    assert env["HF_TOKEN"] == secret_value                   # the engine gets the token, as a variable only
    assert argv[argv.index("--served-model-name") + 1] == "org/m"
    assert f"--extra={LEAK}" in argv and env["MINE"] == LEAK
    assert not any(secret_value in word for word in argv)
    assert all(secret_value not in v for k, v in env.items() if k != "HF_TOKEN")
    # The operator's own reference still expands: the pod's address.
    assert argv[argv.index("--data-address") + 1] == f"{env['POD_IP']}:7600"
    # Stored escaped, in the Pod as in the Deployment's template: `$$` is the kubelet's `$`.
    stored = engine["args"]
    assert "--extra=$$(HF_TOKEN)" in stored
    assert {"name": "MINE", "value": "$$(HF_TOKEN)"} in engine["env"]
    template = container(get(cluster, "deployment", ns, f"{SERVING}-prefill")["spec"]["template"]["spec"], "engine")
    assert template["args"] == stored
