"""A reconcile pass, as every kind's reconcile runs it: what it talks to (`Deps`, injected),
its record (`Pass`: events, issues, failed requests, when to come back) and its end, the one
status write (`Pass.finish`; `Pass.invalid` for a spec that cannot be realised, `Pass.finish_held`
for a pass a failed request stopped).

Every pass (create, update, resume, timer) does: parse -> plan -> act on the cloud (GKE) ->
server-side apply children, delete stale ones (touching only what it owns: apply_all) ->
observe -> write status once -> emit events -> raise TemporaryError if it should come back
sooner than the timer. It is idempotent: running it twice changes nothing the second time.
The passes: reconcile_pool.py (TPUSyncPool; its GKE node pools in nodepools.py) and
reconcile_serving.py (DisaggregatedServing).

A request to the Kubernetes API that fails (a 5xx, a timeout, a refusal) stops the pass where
it is: what it did not observe is not "nothing there". Its status then keeps every value
observed before, Ready and Progressing as they were, and Degraded names the failed request
(`held_conditions`); the pass comes back soon."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import aiohttp
import kopf
from pydantic import BaseModel, ValidationError

from .builders.common import Owner
from .gke import GKEClient
from .kube import Kube, KubeError
from .ownership import Conflict, conflict, owned
from .pool_plan import Child, Ref
from .status import API_ERROR, REJECTED, Clock, Cond, held_conditions, merge_conditions, transitions, utc_now

SpecT = TypeVar("SpecT", bound=BaseModel)
Emit = Callable[[dict[str, Any], str, str, str], None]   # (body, type, reason, message)


def _token() -> bytes:
    return secrets.token_bytes(32)


ReadText = Callable[[str], Awaitable[str]]   # an http:// URL -> the body of a 200 response; raises OSError otherwise
ENGINE_READ_SECONDS = 3.0


async def _read_text(url: str) -> str:
    """GET url (an engine's /metrics): its body, or OSError naming what went wrong."""
    timeout = aiohttp.ClientTimeout(total=ENGINE_READ_SECONDS)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise OSError(f"HTTP {response.status}")
            return await response.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise OSError(str(e) or type(e).__name__) from e


@dataclass
class Deps:
    """Everything a reconcile pass talks to, injected (tests pass fakes)."""
    kube: Kube
    emit: Emit                        # events.EventPoster.emit: any task may post
    gke: GKEClient | None = None      # on the endpoint of the operator's configuration
    now: Clock = utc_now
    token: Callable[[], bytes] = _token
    read_text: ReadText = _read_text   # the engines' /metrics (their KV-path counters)



@dataclass
class Pass:
    """Per-pass accumulator: events are held until the status write has succeeded. Made from the
    object's body and the status model its one status write fills."""
    body: dict[str, Any]
    status_model: type[BaseModel]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    issues: list[Cond] = field(default_factory=list)
    failures: list[Cond] = field(default_factory=list)   # requests that failed: what it could not observe
    retry: tuple[float, str] | None = None
    owner: Owner = field(init=False)
    generation: int | None = field(init=False)
    old: dict[str, Any] = field(init=False)           # the status the pass started from

    def __post_init__(self) -> None:
        self.owner = Owner.from_body(self.body)
        self.generation = self.body["metadata"].get("generation")
        self.old = self.body.get("status") or {}

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def issue(self, reason: str, message: str, retry: float | None = None, *, first: bool = False) -> None:
        """A cause of Degraded; the first one names its reason (`first`: this one)."""
        self.issues.insert(0 if first else len(self.issues), Cond("Degraded", True, reason, message))
        if retry is not None:
            self.again(retry, message)

    def again(self, delay: float, message: str) -> None:
        if self.retry is None or delay < self.retry[0]:
            self.retry = (delay, message)

    def request_failed(self, e: KubeError) -> None:
        """Records the request that stopped the pass; it comes back sooner after a transient
        failure than after a refusal (which needs a fix: RBAC, a webhook...)."""
        if e.status in (400, 403, 422):
            self.again(60, str(e))
            self.failures.append(Cond("Degraded", True, REJECTED, str(e)))
        else:
            self.again(10, str(e))
            self.failures.append(Cond("Degraded", True, API_ERROR, f"{e}; the status shows what was observed before"))

    def conditions(self, deps: Deps, observed: Sequence[Cond]) -> list[dict[str, Any]]:
        """The conditions observed, merged into those the pass started from."""
        return merge_conditions(self.old.get("conditions"), list(observed), self.generation, deps.now())

    async def spec(self, deps: Deps, model: type[SpecT]) -> SpecT:
        """The spec parsed, or the pass ended as InvalidSpec naming the field."""
        try:
            return model.model_validate(self.body.get("spec") or {})
        except ValidationError as e:
            await self.invalid(deps, validation_message(e))

    async def finish(self, deps: Deps, values: dict[str, Any]) -> dict[str, Any]:
        """Writes the status (once), then emits the pass's events and the condition transitions'
        events; raises kopf.TemporaryError if the pass asked to come back. Returns the status."""
        meta = self.body["metadata"]
        old = (self.body.get("status") or {}).get("conditions")
        status = _full_status(self.status_model, values)
        await deps.kube.patch_status(self.owner.api_version, self.owner.kind, meta["namespace"], meta["name"], status)
        was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in old or [])
        for c in transitions(old, status["conditions"]):
            if c["type"] == "Ready" and c["status"] == "True":
                self.event("Normal", "Ready", c["message"])
            elif c["type"] == "Ready" and was_ready:
                self.event("Warning", "NotReady", f"{c['reason']}: {c['message']}")
            elif c["type"] == "Degraded" and c["status"] == "True":
                self.event("Warning", c["reason"], c["message"])
        for type_, reason, message in self.events:
            deps.emit(self.body, type_, reason, message)
        if self.retry is not None:
            raise kopf.TemporaryError(self.retry[1], delay=self.retry[0])
        return status

    async def invalid(self, deps: Deps, message: str) -> NoReturn:
        """Ends a pass over a spec that cannot be realised: InvalidSpec, and kopf.PermanentError."""
        conds = self.conditions(deps, [Cond("Ready", False, "InvalidSpec", message),
                                       Cond("Progressing", False, "InvalidSpec", message),
                                       Cond("Degraded", True, "InvalidSpec", message)])
        await self.finish(deps, {**self.old, "observedGeneration": self.generation, "conditions": conds})
        raise kopf.PermanentError(message)

    async def finish_held(self, deps: Deps, e: KubeError, keep: Sequence[str], **values: Any) -> dict[str, Any]:
        """Ends a pass that a failed request stopped: the status fields `keep` as last written,
        Degraded naming the request (held_conditions), and `values` (what this pass did observe)."""
        self.request_failed(e)
        held = await stored_status(deps.kube, self)
        conds = held_conditions(held.get("conditions"), self.failures + self.issues, self.generation, deps.now())
        return await self.finish(deps, {**kept(held, *keep), "conditions": conds, **values})


def _full_status(model: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """Every status field, None included, so a merge patch also clears stale fields."""
    out: dict[str, Any] = {f.alias or k: None for k, f in model.model_fields.items()}
    out.update(values)
    return out


def validation_message(e: ValidationError, root: str = "spec") -> str:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"{root}.{loc}: {first['msg']}"


@dataclass(frozen=True)
class Written:
    """What apply_all did: nothing, for the conflicts; or everything, creating `created`."""
    conflicts: list[Conflict]
    created: list[str]      # names of the `once` children created by this pass


@dataclass(frozen=True)
class Read:
    """The wanted children as the API server holds them (None: absent), and the names among
    them held by objects the owner does not own."""
    once: list[Child]
    apply: list[Child]
    live: list[dict[str, Any] | None]
    conflicts: list[Conflict]


async def read_wanted(kube: Kube, owner: Owner, apply: Sequence[Child], once: Sequence[Child] = ()) -> Read:
    """Reads every wanted child (ownership.py decides whose each is). A pass reads before it
    writes anything, the GKE API's node pools included: a conflict stops it before any write."""
    wanted = [*once, *apply]
    live = [await kube.get(o["apiVersion"], o["kind"], owner.namespace, o["metadata"]["name"]) for o in wanted]
    conflicts = [c for obj in live if obj is not None and (c := conflict(owner, obj)) is not None]
    return Read(list(once), list(apply), live, conflicts)


async def apply_all(kube: Kube, owner: Owner, read: Read, delete: Sequence[Ref]) -> Written:
    """Writes the children read (read_wanted), touching only what the owner owns. If any of
    their names is held by an object the owner does not own, nothing at all is written and the
    conflicts are returned. Otherwise the `once` children (generated Secrets: re-applying would
    rotate a token under running pods) are created where absent, the `apply` children
    server-side applied, and the stale ones (`delete`) deleted where they exist and are the
    owner's; another's object at a stale name is left alone.

    Each write of an object read carries the uid it had (a patch's metadata.uid, a delete's
    preconditions): the API server refuses it (422 for a patch: metadata.uid is immutable; 409
    for a delete) if the object was replaced in between; the pass is retried, and the next one
    names the conflict. One window remains: a name free when read and taken by another's
    object before the apply creates it is applied over (server-side apply has no create-only
    mode; a POST would leave the fields to an Update manager the applies never prune)."""
    if read.conflicts:
        return Written(read.conflicts, [])
    created = []
    for obj, found in zip(read.once, read.live, strict=False):
        if found is None and await kube.create(obj):
            created.append(obj["metadata"]["name"])
    for obj, found in zip(read.apply, read.live[len(read.once):], strict=True):
        await kube.apply(_with_uid(obj, found))
    for ref in delete:
        found = await kube.get(ref.api_version, ref.kind, owner.namespace, ref.name)
        if found is not None and owned(owner, found):
            await kube.delete(ref.api_version, ref.kind, owner.namespace, ref.name, uid=found["metadata"].get("uid"))
    return Written([], created)


def _with_uid(obj: Child, found: dict[str, Any] | None) -> Child:
    """obj as a patch of exactly the object read (its uid: a precondition of the patch)."""
    uid = (found or {}).get("metadata", {}).get("uid")
    return {**obj, "metadata": {**obj["metadata"], "uid": uid}} if uid else obj


def kept(old: dict[str, Any], *names: str) -> dict[str, Any]:
    """The named status fields as last written (None where never written)."""
    return {n: old.get(n) for n in names}


async def stored_status(kube: Kube, p: Pass) -> dict[str, Any]:
    """The status as the API server holds it now, for a pass that could not observe and so
    holds what was last written: the body the pass started from may predate the last status
    write (its watch event can lag), and holding that would take back what was observed since.
    The pass's body takes it, so the condition events compare with it too."""
    try:
        body = await kube.get(p.owner.api_version, p.owner.kind, p.owner.namespace, p.owner.name)
    except KubeError:
        body = None
    if body is not None:
        p.body = {**p.body, "status": body.get("status") or {}}
    return p.body.get("status") or {}
