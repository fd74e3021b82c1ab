"""Spec strings on container command lines are not expanded by Kubernetes.

The kubelet expands `$(NAME)` in a container's command, args and env values to the value of
the container's variable NAME. A serving whose model name is `$(HF_TOKEN)` and whose
`spec.model.tokenSecretRef` names any Secret of the namespace would otherwise serve that
Secret's value as its model name (listed by /v1/models to every client). Every spec string
the builders put on a command line or into an env value goes through
`builders.common.verbatim`, and the container sees it as written; the operator's own
references (`$(POD_IP)`) still expand.

What a container sees is computed with the kubelet's rule (harness/kube_expansion.py,
a port of Kubernetes' expansion package, checked here against the cases of its own tests).
"""

from __future__ import annotations

import pytest
from op_helpers import PoolBody, ServingBody

from harness.kube_expansion import command_line, environment, expand
from tpusync_operator.builders.common import Owner, pod_templates, verbatim
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.pool_plan import PlanError
from tpusync_operator.serving_plan import plan_serving
from tpusync_operator.tpu import slice_for

# From k8s.io/kubernetes v1.37.2 third_party/forked/golang/expansion/expand_test.go
# (doExpansionTest), over its context VAR_A=A, VAR_B=B, VAR_C=C, VAR_REF=$(VAR_A), VAR_EMPTY="".
CONTEXT = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)", "VAR_EMPTY": ""}
UPSTREAM_CASES = [
    ("$(VAR_A)", "A"), ("$(VAR_A)-$(VAR_A)", "A-A"), ("___$(VAR_B)___", "___B___"),
    ("$(VAR_A)_$(VAR_B)_$(VAR_C)", "A_B_C"), ("$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),
    ("$$(VAR_A)_$$(VAR_B)", "$(VAR_A)_$(VAR_B)"), ("f000-$$VAR_A", "f000-$VAR_A"),
    ("foo\\$(VAR_C)bar", "foo\\Cbar"), ("$(VAR_A$(VAR_B))", "$(VAR_A$(VAR_B))"),
    ("$(VAR_A$(VAR_B)", "$(VAR_A$(VAR_B)"), ("$(VAR_REF)", "$(VAR_A)"), ("foo$(VAR_EMPTY)bar", "foobar"),
    ("foo$(VAR_Awhoops!", "foo$(VAR_Awhoops!"), ("$?_boo_$!", "$?_boo_$!"), ("$VAR_A", "$VAR_A"),
    ("$(VAR_DNE)", "$(VAR_DNE)"), ("$$$$$$(BIG_MONEY)", "$$$(BIG_MONEY)"), ("$$$$$$(VAR_A)", "$$$(VAR_A)"),
    ("$$$$$$$(GOOD_ODDS)", "$$$$(GOOD_ODDS)"), ("$$$$$$$(VAR_A)", "$$$A"), ("${VAR_A}", "${VAR_A}"),
    ("$(VAR_B)_______$(A", "B_______$(A"), ("$(VAR_C)_______$(", "C_______$("),
    ("$(VAR_A)foobarzab$", "Afoobarzab$"), ("--$($($($($--", "--$($($($($--"), ("$(foo$$var)", "$(foo$$var)"),
    ("prefix-$€-suffix", "prefix-$€-suffix"),
]


@pytest.mark.parametrize("value,expanded", UPSTREAM_CASES)
def test_the_expansion_port_agrees_with_kubernetes_own_cases(value, expanded):
    assert expand(value, CONTEXT) == expanded


@pytest.mark.parametrize("value", [
    "$(HF_TOKEN)", "$(VAR_A)", "$$(VAR_A)", "a$b", "$", "$$", "$(", "$(VAR_A", "x$(VAR_A)y$(VAR_B)$",
    "$$$(VAR_A)", "${VAR_A}", "€$(VAR_A)", "no dollar at all", "",
])
def test_verbatim_is_undone_by_the_expansion_and_nothing_else(value):
    assert expand(verbatim(value), {**CONTEXT, "HF_TOKEN": "secret"}) == value


SECRET = "hf_not-for-the-model-name"
POD_IP = "10.1.2.3"
TOKEN = {"name": "any-secret-of-the-namespace", "key": "token"}
LEAK = "$(HF_TOKEN)"


def containers(serving: ServingBody, pool: PoolBody):
    """Every container of every pod the serving's plan renders, with its environment as the
    kubelet would make it: HF_TOKEN from the Secret, POD_IP from the pod, other fields and the
    operator's generated secrets as placeholders."""
    body, pool_body = serving.build(), pool.build()
    spec = TPUSyncPoolSpec.model_validate(pool_body["spec"])
    info = PoolInfo("pool", spec, slice_for(spec.tpu.type, spec.tpu.topology))
    plan = plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]), info,
                        {"LeaderWorkerSet", "InferencePool", "InferenceObjective", "HTTPRoute"})

    def value_from(ref):
        if ref.get("secretKeyRef", {}).get("name") == TOKEN["name"]:
            return SECRET
        if ref.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            return POD_IP
        return "x"

    for obj in plan.apply:
        for _, tpl in pod_templates(obj):
            for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]:
                yield obj["metadata"]["name"], c, environment(c, value_from)


ENGINES = {
    "reference": ServingBody().spec(engine={"type": "reference"}),
    "vllm-tpu": ServingBody().spec(engine={"type": "vllm-tpu"}),
    "sglang-jax": ServingBody().spec(engine={"type": "sglang-jax", "image": "registry.example/sglang-jax:main"},
                                     kvTransfer={"connector": "sglang-jax"}, routing={"precisePrefixCache": False}),
}
POOLS = {"single-host": PoolBody(), "multi-host": PoolBody().v7x("2x2x2").gke(workloadPolicy="wp")}


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_no_spec_string_picks_up_a_secret(engine, pool):
    """Every spec string that reaches a command line or an env value holds `$(HF_TOKEN)`; HF_TOKEN
    is in the engine's environment (tokenSecretRef): not one word or value of any container
    expands to the Secret. (The schema refuses `$` in the model's name and revision, and
    routing.proxyKvConnector is one of an enum: the corpus of harness/invalid_objects.py.)"""
    serving = ENGINES[engine].spec(
        model={"tokenSecretRef": TOKEN},
        prefill={"args": [f"--extra={LEAK}"]}, decode={"args": [f"--extra={LEAK}"]},
        engine={"env": [{"name": "MINE", "value": LEAK}]})
    if (engine, pool) == ("sglang-jax", "multi-host"):
        with pytest.raises(PlanError, match="sglang-jax on single-host slices only"):
            list(containers(serving, POOLS[pool]))
        return
    seen = list(containers(serving, POOLS[pool]))
    engines = [(name, c, env) for name, c, env in seen if c["name"] == "engine"]
    assert engines
    for name, c, env in seen:
        argv = command_line(c, env)
        assert not any(SECRET in word for word in argv), (name, c["name"], argv)
        assert all(SECRET not in v for k, v in env.items() if k != "HF_TOKEN"), (name, c["name"], env)
    served = 0
    for name, c, env in engines:
        assert env["HF_TOKEN"] == SECRET                  # the engine does get the token, as a variable
        assert env["MINE"] == LEAK
        argv = command_line(c, env)
        if "--served-model-name" in argv:                # a Ray worker of a multi-host vLLM replica has none
            served += 1
            assert f"--extra={LEAK}" in argv, (name, argv)
            assert "--extra=$$(HF_TOKEN)" in c["args"]     # as stored
    assert served


def test_the_operators_own_references_still_expand():
    """The escaping is of spec strings only: $(POD_IP) in the data address and the KV-event
    topic is the kubelet's to fill in, and an argument with $ in it stays as written."""
    serving = ServingBody().spec(prefill={"args": ["--extra=m$(POD_IP)"]}, routing={"proxyKvConnector": "nixlv2"})
    for _, c, env in containers(serving, PoolBody()):
        if c["name"] != "engine":
            continue
        argv = command_line(c, env)
        assert argv[argv.index("--data-address") + 1] == f"{POD_IP}:7600"
        assert argv[argv.index("--kv-events-topic") + 1] == f"kv@{POD_IP}:8000@m"
        if "prefill" in argv:
            assert "--extra=m$(POD_IP)" in argv


def test_a_model_path_is_loaded_as_written():
    serving = ServingBody().spec(model={"name": "m", "uri": "/models/$(POD_NAME)/w"})
    (argv,) = [command_line(c, env) for _, c, env in containers(serving, PoolBody())
               if c["name"] == "engine" and "--role" in c["args"] and "prefill" in c["args"]]
    assert argv[argv.index("--model") + 1] == "/models/$(POD_NAME)/w"
