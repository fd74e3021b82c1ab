"""The host's head: which version of a model is current on this host.

Blocks are content-addressed and never rewritten, so "current" cannot be a block: it is the
head file `<pool path>.weights/<model>.head` beside the pool in /dev/shm (as durable as the
pool itself), advanced only forward, atomically (write + rename under an flock), and only
after the version's commit record is stored. A trainer process's part has a part head.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from typing import Any

from tpusync.weights.keys import Part


def head_path(pool_path: str, model: str, *, part: bool = False) -> str:
    """The host's head file for a model's whole versions, or (part=True) for its trainer part."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model)[:64]
    tag = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{pool_path}.weights/{safe}-{tag}.{'parthead' if part else 'head'}"


def _read_head_file(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            head: dict[str, Any] = json.load(f)
            return head
    except FileNotFoundError:
        return None


def read_head(pool_path: str, model: str) -> int | None:
    """The newest version committed on this host, or None."""
    head = _read_head_file(head_path(pool_path, model))
    return None if head is None else int(head["version"])


def read_part_head(pool_path: str, model: str) -> tuple[int, Part] | None:
    """The newest version this host published a part of, and which part, or None."""
    head = _read_head_file(head_path(pool_path, model, part=True))
    return None if head is None else (int(head["version"]), (int(head["part"][0]), int(head["part"][1])))


def advance_head(pool_path: str, model: str, version: int, part: Part | None = None) -> int | None:
    """Makes `version` the host's current version (or part) if it is newer; returns the previous head."""
    path = head_path(pool_path, model, part=part is not None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        head = _read_head_file(path)
        previous = None if head is None else int(head["version"])
        if previous is not None and previous >= version:
            return previous
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"model": model, "version": int(version), **({"part": list(part)} if part else {})}, f)
        os.replace(tmp, path)
        return previous
