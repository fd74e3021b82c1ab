"""Prefill and decode on pools of their own (spec.<role>.poolRef): another TPU type or slice shape
per role. Each role's pods run on its pool's nodes with its pool's parallelism and sidecar, the
sidecars may dial the other pool's members, the pools must authenticate and store blocks alike,
and what the two roles could not exchange is refused before it runs."""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest
from op_helpers import FakeKube, PoolBody, ServingBody
from test_operator_builders_serving import _pods, plan
from test_operator_reconcile import deps
from test_operator_reconcile import run as reconcile

from tpusync_operator import handlers
from tpusync_operator.pool_plan import PlanError
from tpusync_operator.reconcile_serving import reconcile_serving
from tpusync_operator.render import check
from tpusync_operator.validate import validate

SHARED_AUTH = {"auth": {"secretName": "kv-auth"}}


def v7x_prefill_pool(**patch) -> PoolBody:
    return PoolBody("v7x").v7x().spec(**SHARED_AUTH).spec(**patch)


def v6e_decode_pool(**patch) -> PoolBody:
    return PoolBody("v6e").spec(tpu={"topology": "2x2"}, provisioning={"existing": {"nodePoolName": "v6e-np"}},
                                **SHARED_AUTH).spec(**patch)


def mixed(**spec) -> ServingBody:
    """A vLLM serving whose prefill runs on spec.poolRef (v7x) and decode on a v6e pool of its own."""
    return ServingBody(pool="v7x").spec(engine={"type": "vllm-tpu"}, decode={"poolRef": {"name": "v6e"}}).spec(**spec)


def mixed_plan(serving=None, prefill_pool=None, decode_pool=None):
    return plan(serving or mixed(), prefill_pool or v7x_prefill_pool(),
                role_pools={"decode": decode_pool or v6e_decode_pool()})


def args_of(container) -> list[str]:
    return container.get("args", [])


def test_each_role_runs_on_its_pool_with_its_parallelism_and_sidecars_that_may_dial_the_other_pool():
    pods = dict(_pods(mixed_plan().apply))
    prefill, decode = pods["llm-prefill"], pods["llm-decode"]
    for tpl, pool, accelerator, topology, tp in ((prefill, "v7x", "tpu7x", "2x2x1", "8"),
                                                 (decode, "v6e", "tpu-v6e-slice", "2x2", "4")):
        labels, spec = tpl["metadata"]["labels"], tpl["spec"]
        assert labels["tpusync.dev/pool"] == pool
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == accelerator
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
        engine = spec["containers"][0]
        assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == tp
        sidecar = spec["initContainers"][0]
        other = "v6e" if pool == "v7x" else "v7x"
        assert f"--peers-dns={pool}-peers.ns.svc" in args_of(sidecar)
        assert f"--peers={other}-peers.ns.svc:7600" in args_of(sidecar)
        auth = next(v for v in spec["volumes"] if v["name"] == "tpusync-auth")
        assert auth["secret"]["secretName"] == "kv-auth"


def test_one_pool_renders_no_cross_pool_peers():
    pods = dict(_pods(plan(ServingBody().spec(engine={"type": "vllm-tpu"}), PoolBody()).apply))
    assert not any(a.startswith("--peers=") for t in pods.values() for a in args_of(t["spec"]["initContainers"][0]))


def test_the_serving_policy_admits_the_other_pools_pods_to_the_data_port():
    """The prefill pool's own policy admits only its members to the data port; the serving's
    policy (policies are additive) admits the serving's decode pods, which are the other pool's."""
    objs = mixed_plan().apply
    pods = dict(_pods(objs))
    decode_labels, prefill_labels = pods["llm-decode"]["metadata"]["labels"], pods["llm-prefill"]["metadata"]["labels"]
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "llm-serving")

    def selects(selector, labels):
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items())
    assert selects(policy["spec"]["podSelector"], prefill_labels)
    admits = [rule for rule in policy["spec"]["ingress"]
              if "ports" not in rule and any(selects(f["podSelector"], decode_labels) for f in rule.get("from", []))]
    assert admits, policy["spec"]["ingress"]
    other_serving = {**decode_labels, "tpusync.dev/serving": "another"}
    assert not any(selects(f["podSelector"], other_serving) for rule in policy["spec"]["ingress"]
                   for f in rule.get("from", []))


@pytest.mark.parametrize("decode_pool,match", [
    (v6e_decode_pool(auth={"secretName": "other"}), r"spec\.decode\.poolRef\.name: TPUSyncPool v6e authenticates .* "
                                                    r"Secret other and TPUSyncPool v7x with kv-auth"),
    (PoolBody("v6e").spec(tpu={"topology": "2x2"}), r"Secret v6e-auth and TPUSyncPool v7x with kv-auth"),
    (v6e_decode_pool(tiers={"blockBytes": "2Mi"}), r"spec\.tiers\.blockBytes 2Mi and TPUSyncPool v7x 1Mi"),
    (v6e_decode_pool(sidecar={"kvEventsPort": 5558}), r"spec\.sidecar\.kvEventsPort 5558 .* 5557"),
])
def test_pools_that_could_not_exchange_blocks_are_refused(decode_pool, match):
    with pytest.raises(PlanError, match=match):
        mixed_plan(decode_pool=decode_pool)


@pytest.mark.parametrize("connector", ["tpu-inference", "tpu-sync-compatible"])
def test_connectors_that_pair_hosts_by_rank_need_one_slice_shape(connector):
    with pytest.raises(PlanError, match=r"spec\.decode\.poolRef\.name: TPUSyncPool v6e is a v6e 2x2 slice and "
                                        r"TPUSyncPool v7x a v7x 2x2x1 slice"):
        mixed_plan(mixed(kvTransfer={"connector": connector}))
    # The same shape on another pool is fine for them.
    same = v6e_decode_pool(tpu={"type": "v7x", "topology": "2x2x1"})
    assert mixed_plan(mixed(kvTransfer={"connector": connector}), decode_pool=same).roles


def test_a_role_topology_is_checked_against_its_own_pool():
    with pytest.raises(PlanError, match=r"spec\.decode\.topology 2x2x1 .* spec\.decode\.poolRef \(TPUSyncPool v6e\)"):
        mixed_plan(mixed(decode={"topology": "2x2x1"}))
    assert mixed_plan(mixed(decode={"topology": "2x2"}, prefill={"topology": "2x2x1"})).roles


def test_capacity_is_counted_per_pool():
    from tpusync_operator.serving_plan import capacity_shortfall
    roles = mixed_plan(mixed(decode={"replicas": 2})).roles
    assert capacity_shortfall(roles) == ("spec.decode need 2 TPU hosts (decode 2 x 1) but TPUSyncPool v6e has 1; "
                                         "the replicas that do not fit stay Pending")
    assert capacity_shortfall(mixed_plan(mixed(decode={"replicas": 2}),
                                         decode_pool=v6e_decode_pool(capacity={"hosts": 2})).roles) is None


@pytest.mark.parametrize("engine,prefill_args,decode_args,refused", [
    ("vllm-tpu", [], ["--kv-cache-dtype=fp8"], r"--kv-cache-dtype fp8 differs from spec\.prefill\.args' \(unset\)"),
    ("vllm-tpu", ["--dtype", "bfloat16"], ["--dtype=float32"], r"--dtype float32 differs .* bfloat16"),
    ("vllm-tpu", ["-q", "fp8"], ["--quantization=int8"], r"--quantization int8"),
    ("vllm-tpu", ["--dtype=bfloat16", "--max-num-seqs=8"], ["--dtype", "bfloat16", "--max-num-seqs=64"], None),
    ("reference", ['--model-config={"kv_heads": 2}'], ['--model-config={"kv_heads": 4}'], r"--model-config"),
    ("reference", ['--model-config={"kv_heads": 2, "page_size": 16}'],
     ['--model-config={"kv_heads": 2, "page_size": 32, "max_seq": 8192}'], None),   # page size is regrouped
    ("reference", ["--hash-seed=a"], [], r"--hash-seed \(unset\) differs"),
])
def test_role_args_that_change_the_kv_layout_must_agree(engine, prefill_args, decode_args, refused):
    serving = ServingBody().spec(engine={"type": engine}, prefill={"args": prefill_args},
                                 decode={"args": decode_args})
    if refused is None:
        assert plan(serving, PoolBody()).roles
    else:
        with pytest.raises(PlanError, match=r"spec\.decode\.args: " + refused):
            plan(serving, PoolBody())


def docs(*bodies):
    """The bodies as a user writes them: no uid, generation or status."""
    out = [copy.deepcopy(b) for b in bodies]
    for b in out:
        b["metadata"] = {k: v for k, v in b["metadata"].items() if k in ("name", "namespace")}
        b.pop("status", None)
    return out


def test_validate_names_the_field_of_a_missing_role_pool_and_refuses_two_role_pools():
    assert check(docs(v7x_prefill_pool().build(), v6e_decode_pool().build(), mixed().build())) == []
    errors = check(docs(v7x_prefill_pool().build(), mixed().build()))
    assert errors == ["DisaggregatedServing ns/llm: spec.decode.poolRef.name 'v6e': no TPUSyncPool of that name in "
                      "namespace ns in the files given, and no cluster to read it from (--cluster none)"]
    both = mixed(prefill={"poolRef": {"name": "v7x"}}).build()
    _, schema_errors = validate(docs(both)[0])
    assert any("spec.prefill.poolRef and spec.decode.poolRef: set at most one" in str(e) for e in schema_errors), \
        schema_errors


def test_reconcile_fetches_each_pool_and_names_the_missing_one(clock):
    kube = FakeKube()
    kube.put(v7x_prefill_pool().ready().build())
    with pytest.raises(kopf.TemporaryError, match="TPUSyncPool v6e not found"):
        reconcile(reconcile_serving, mixed().build(), deps(kube, clock))
    cond = {c["type"]: c for c in kube.find("DisaggregatedServing", "llm")["status"]["conditions"]}
    assert cond["Degraded"]["reason"] == "PoolNotFound"
    assert cond["Degraded"]["message"].startswith("spec.decode.poolRef.name: TPUSyncPool v6e not found")

    kube.put(v6e_decode_pool().build())                  # not Ready yet
    status = reconcile(reconcile_serving, mixed().build(), deps(kube, clock))
    assert kube.find("Deployment", "llm-decode")["metadata"]["labels"]["tpusync.dev/pool"] == "v6e"
    assert kube.find("Deployment", "llm-prefill")["metadata"]["labels"]["tpusync.dev/pool"] == "v7x"
    cond = {c["type"]: c for c in status["conditions"]}
    assert "TPUSyncPool not ready" in cond["Progressing"]["message"]
    assert cond["Degraded"]["status"] == "False", cond["Degraded"]


def test_a_change_of_a_role_pool_triggers_the_serving():
    from test_operator_handlers import FakeQueue
    memo = type("Memo", (), {})()
    memo.objects, memo.selectors, memo.pool_views, memo.passes = {}, {}, {}, FakeQueue()
    serving = {"metadata": {"namespace": "ns", "name": "s"},
               "spec": {"poolRef": {"name": "p"}, "decode": {"poolRef": {"name": "q"}}}}
    asyncio.run(handlers.serving_seen(event={"type": "ADDED"}, body=serving, memo=memo))
    pool = {"metadata": {"namespace": "ns", "name": "q"},
            "spec": {"tpu": {"type": "v6e", "topology": "2x2"},
                     "provisioning": {"mode": "existing", "existing": {"nodePoolName": "np"}}}}
    asyncio.run(handlers.pool_seen(event={"type": "ADDED"}, body=pool, memo=memo))
    assert memo.passes.requested == [("DisaggregatedServing", "ns", "s")]


def test_a_multi_host_role_on_its_own_pool_gives_each_host_its_sidecar_and_the_other_pools_peers():
    """Prefill on one v6e pool, decode on a v7x multi-host pool of its own: the decode role is a
    LeaderWorkerSet of a whole 2x2x2 slice per replica, leader and worker each with a sidecar of
    the decode pool that may dial the prefill pool."""
    serving = ServingBody(pool="v6e").spec(engine={"type": "vllm-tpu"}, decode={"poolRef": {"name": "v7x"}})
    decode_pool = PoolBody("v7x").v7x("2x2x2").spec(capacity={"hosts": 2}, **SHARED_AUTH)
    p = plan(serving, v6e_decode_pool(), role_pools={"decode": decode_pool})
    roles = {r.role: r for r in p.roles}
    assert (roles["decode"].kind, roles["decode"].hosts_per_replica) == ("LeaderWorkerSet", 2)
    assert (roles["prefill"].kind, roles["prefill"].hosts_per_replica) == ("Deployment", 1)
    pods = dict(_pods(p.apply))
    for part in ("llm-decode-leader", "llm-decode-worker"):
        tpl = pods[part]
        assert tpl["metadata"]["labels"]["tpusync.dev/pool"] == "v7x"
        assert tpl["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x2"
        sidecar = tpl["spec"]["initContainers"][0]
        assert {"--peers-dns=v7x-peers.ns.svc", "--peers=v6e-peers.ns.svc:7600"} <= set(args_of(sidecar))
    leader = pods["llm-decode-leader"]["spec"]["containers"][0]["args"]
    assert leader[leader.index("--tensor-parallel-size") + 1] == "16"
