"""Which objects a custom resource may write (pure).

Children are addressed by name (builders/names.py), so a name a TPUSyncPool or
DisaggregatedServing wants may already be held by an object the operator did not make for
it: another team's, or another tpusync object's child. The reconcile layer reads every child
before it applies or deletes it (reconcile.apply_all) and writes only the ones `owned` here.
A wanted name held by another's object is a `Conflict`: the pass writes nothing, and its
status names the object, who holds it, and the field that makes the name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .builders.common import MANAGED_BY, Owner

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
INSTANCE_LABEL = "app.kubernetes.io/instance"
# How often a pass stopped by a conflict runs again: another's object is not watched (it lacks
# the operator's labels), so its removal triggers nothing.
CONFLICT_RETRY_SECONDS = 30.0


def _controller(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


def owned(owner: Owner, obj: Mapping[str, Any]) -> bool:
    """Whether obj is owner's child. Every child the operator ever made carries a controller
    owner reference with its owner's uid; a controller reference with any other uid (another
    tpusync object, an earlier object of the same name whose children the garbage collector
    has not removed yet, another controller) makes it another's. Without a controller
    reference it is owner's when it carries the operator's labels for this very object
    (managed-by tpusync-operator, instance <name>): a child orphaned by deleting an earlier
    object of this name with `--cascade=orphan`, adopted as a Deployment adopts its
    ReplicaSets."""
    meta = obj.get("metadata") or {}
    controller = _controller(meta)
    if controller is not None:
        return bool(controller.get("uid") == owner.uid)
    if any(r.get("uid") == owner.uid for r in meta.get("ownerReferences") or []):
        return True
    labels = meta.get("labels") or {}
    return bool(labels.get(MANAGED_BY_LABEL) == MANAGED_BY and labels.get(INSTANCE_LABEL) == owner.name)


@dataclass(frozen=True)
class Conflict:
    """A name the owner wants, held by an object it does not own."""
    kind: str
    namespace: str
    name: str
    holder: str     # who holds it: its controller, else the managers of its fields

    def describe(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name} ({self.holder})"


def holder(meta: Mapping[str, Any]) -> str:
    controller = _controller(meta)
    if controller is not None:
        return f"owned by {controller.get('kind')} {controller.get('name')} (uid {controller.get('uid')})"
    # Who wrote it, not who reports on it: a controller's status writes are its subresource's.
    managers = sorted({str(m["manager"]) for m in meta.get("managedFields") or []
                       if m.get("manager") and not m.get("subresource")})
    return "managed by " + ", ".join(managers) if managers else "no owner reference"


def conflict(owner: Owner, obj: Mapping[str, Any]) -> Conflict | None:
    """None when obj is owner's; otherwise the conflict its name makes."""
    if owned(owner, obj):
        return None
    meta = obj.get("metadata") or {}
    return Conflict(str(obj.get("kind", "")), str(meta.get("namespace", owner.namespace)), str(meta.get("name", "")),
                    holder(meta))


def conflict_message(owner: Owner, conflicts: Sequence[Conflict]) -> str:
    """What the status says: the objects, that they are left alone, and the way out. Every child
    name is the owner's metadata.name with a suffix (builders/names.py)."""
    one = len(conflicts) == 1
    return (f"{'; '.join(c.describe() for c in conflicts)} {'exists and is' if one else 'exist and are'} not this "
            f"{owner.kind}'s: {'it is' if one else 'they are'} left as {'it is' if one else 'they are'}, and none "
            f"of this {owner.kind}'s children is applied or deleted until the name is free. The names of its "
            f"children come from its metadata.name ({owner.name}): create the {owner.kind} under another name, or "
            f"remove or rename {'that object' if one else 'those objects'}; the operator looks again every "
            f"{CONFLICT_RETRY_SECONDS:g} s")
