"""Whether a serving's KV path really works, from its engines' own counters (pure).

An engine whose prefill-to-decode path does nothing still answers every request: decode
recomputes the prompt, HTTP stays 200 and the pods stay Ready (KServe users found P/D disabled
this way). Every engine tpusync serves exports what its KV path did on its /metrics, under the
names of tpusync.kv.path_metrics (the runtime's; the operator meets it on the wire and holds the
names here again, a test keeps the two equal). Each pass reads them from every serving pod;
the status keeps the role totals, and the next pass judges what happened in between:

    KVPath False  NoConnector      a serving pod exports no tpusync KV counters (no connector)
                  ConnectorOff     a connector switched itself off (tpusync_kv_connector_off)
                  PullsFailing     pulls from a prefill's or a peer's sidecar failed
                  HandoffsRefused  decode refused prefills' hand-offs (another layout, other keys)
                  NoHandoffs       decode served requests, none came with a prefill's hand-off
                  NotPulling       hand-offs came, and decode neither pulled nor loaded a block
           True   Pulling          hand-offs came and their blocks were pulled or loaded
           Unknown NoTraffic, NotDisaggregated, NotObservable, NoEnginesRead
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .status import Cond

CONDITION = "KVPath"
PREFIX = "tpusync_kv_"
COUNTERS = ("requests", "handoffs", "refused_handoffs", "pulled_blocks", "pull_failures", "loaded_blocks",
            "recomputed_blocks", "saved_blocks")
OFF = "connector_off"
TRAFFIC_VERDICTS = ("Pulling", "PullsFailing", "HandoffsRefused", "NoHandoffs", "NotPulling")


@dataclass(frozen=True)
class EngineReading:
    """One serving pod's KV-path counters, as read from its /metrics."""
    pod: str
    role: str
    counters: dict[str, int] | None = None   # None: its metrics carry no tpusync KV counters
    off: tuple[str, ...] = ()                 # why its connector switched itself off
    error: str = ""                           # the pod could not be read (its counters unknown)


def parse_metrics(text: str) -> tuple[dict[str, int], tuple[str, ...]] | None:
    """(counters summed over label sets, off reasons) from Prometheus text; None when it has no
    tpusync KV counters. Raises ValueError on text Prometheus' own parser refuses."""
    counters: dict[str, int] = {}
    off: set[str] = set()
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if not name.startswith(PREFIX):
                continue
            short = name[len(PREFIX):]
            if short == OFF:
                seen = True
                if sample.value > 0:
                    off.add(sample.labels.get("reason", "unknown"))
            elif short.endswith("_total") and short[:-len("_total")] in COUNTERS:
                seen = True
                key = short[:-len("_total")]
                counters[key] = counters.get(key, 0) + int(sample.value)
    if not seen:
        return None
    return {k: counters.get(k, 0) for k in COUNTERS}, tuple(sorted(off))


def role_totals(readings: list[EngineReading]) -> dict[str, dict[str, int]]:
    """Each role's counters, summed over the pods that could be read."""
    out: dict[str, dict[str, int]] = {}
    for r in readings:
        if r.counters is None:
            continue
        total = out.setdefault(r.role, dict.fromkeys(COUNTERS, 0))
        for k in COUNTERS:
            total[k] += r.counters.get(k, 0)
    return out


def _increase(now: Mapping[str, int], before: Mapping[str, int] | None) -> dict[str, int]:
    """What each counter gained since `before`: a total that fell (a pod restarted, its counters
    started again) counts from zero, as Prometheus' increase() does."""
    out = {}
    for k in COUNTERS:
        n, b = int(now.get(k, 0)), int((before or {}).get(k, 0))
        out[k] = n - b if n >= b else n
    return out


@dataclass
class KVPathObservation:
    disaggregated: bool                        # both roles have replicas
    observable: bool = True                    # the engine exports the counters (sglang-jax does not)
    readings: list[EngineReading] = field(default_factory=list)
    previous: dict[str, dict[str, int]] | None = None   # role totals at the last pass (status.kvPath)
    previous_condition: Cond | None = None


def kv_path_condition(o: KVPathObservation) -> Cond:
    if not o.disaggregated:
        return Cond(CONDITION, None, "NotDisaggregated", "no prefill-to-decode path: one role has no replicas")
    if not o.observable:
        return Cond(CONDITION, None, "NotObservable", "this engine exports no tpusync KV counters")
    read = [r for r in o.readings if not r.error]
    if not read:
        unread = "; ".join(f"{r.pod}: {r.error}" for r in o.readings) or "no ready serving pods"
        return Cond(CONDITION, None, "NoEnginesRead", f"no engine's counters could be read ({unread})")
    missing = [r.pod for r in read if r.counters is None]
    if missing:
        return Cond(CONDITION, False, "NoConnector",
                    f"{', '.join(missing)} export no tpusync KV counters: the engine runs without tpusync's "
                    "connector, so decode recomputes every prompt")
    off = [f"{r.pod} ({', '.join(r.off)})" for r in read if r.off]
    if off:
        return Cond(CONDITION, False, "ConnectorOff",
                    f"tpusync's connector switched itself off on {', '.join(off)}: it passes every request "
                    "through, and decode recomputes (the engine's log says why)")
    totals = role_totals(read)
    decode = _increase(totals.get("decode", {}), (o.previous or {}).get("decode"))
    if decode["pull_failures"]:
        return Cond(CONDITION, False, "PullsFailing",
                    f"{decode['pull_failures']} pulls from a prefill's or a peer's sidecar failed since the last "
                    f"check (their blocks were recomputed); {decode['pulled_blocks']} blocks pulled")
    if decode["refused_handoffs"]:
        return Cond(CONDITION, False, "HandoffsRefused",
                    f"decode refused {decode['refused_handoffs']} of {decode['handoffs']} hand-offs since the last "
                    "check (another KV layout or other keys than its own: see its log) and recomputed them")
    if decode["requests"] and not decode["handoffs"]:
        return Cond(CONDITION, False, "NoHandoffs",
                    f"decode served {decode['requests']} requests since the last check, none with a prefill's "
                    "kv_transfer_params: the router or proxy in front does not run P/D (or every prompt was "
                    "below its P/D threshold)")
    if decode["handoffs"] and not (decode["pulled_blocks"] or decode["loaded_blocks"]):
        return Cond(CONDITION, False, "NotPulling",
                    f"{decode['handoffs']} hand-offs reached decode since the last check, and it neither pulled "
                    "nor loaded a block of them")
    if decode["handoffs"]:
        return Cond(CONDITION, True, "Pulling",
                    f"{decode['handoffs']} hand-offs since the last check: {decode['pulled_blocks']} blocks "
                    f"pulled, {decode['loaded_blocks']} loaded instead of computed")
    prior = o.previous_condition
    if prior is not None and prior.reason in TRAFFIC_VERDICTS:  # no traffic since: the last traffic's verdict holds
        return prior
    return Cond(CONDITION, None, "NoTraffic", "no request has reached decode yet")
