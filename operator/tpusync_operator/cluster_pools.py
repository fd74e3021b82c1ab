"""The TPUSyncPools that servings name, read from a cluster, for `validate` and `render` of a
serving whose pool is not in the files given (an ML team holds the serving, the platform team
its pool). Which cluster: --cluster auto (default) takes a kubeconfig when there is one
(--kubeconfig, else $KUBECONFIG, else ~/.kube/config), else the pod's service account when
running in a pod, else none; kubeconfig and in-cluster insist on theirs; none reads nothing."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MODES = ("auto", "kubeconfig", "in-cluster", "none")
POOL_API = "tpusync.dev/v1alpha1"


class ClusterReadError(Exception):
    """The chosen cluster could not be read: its configuration, or a request that failed."""


@dataclass(frozen=True)
class Source:
    """A resolved choice: mode "kubeconfig", "in-cluster" or "none" (`why`: the reason)."""
    mode: str
    kubeconfig: str | None = None
    context: str | None = None
    why: str = ""

    def describe(self) -> str:
        if self.mode == "kubeconfig":
            context = f" (context {self.context})" if self.context else ""
            return f"the cluster of kubeconfig {self.kubeconfig}{context}"
        return "the cluster this pod runs in" if self.mode == "in-cluster" else "no cluster"


def _kubeconfig_paths(explicit: str | None, environ: Mapping[str, str]) -> list[str]:
    if explicit:
        return [explicit]
    listed = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return listed or [str(Path(environ.get("HOME", str(Path.home()))) / ".kube" / "config")]


def choose(mode: str, kubeconfig: str | None = None, context: str | None = None,
           environ: Mapping[str, str] = os.environ) -> Source:
    """The cluster `mode` names, or (auto) the one this environment has, if any."""
    if mode == "none":
        return Source("none", why="--cluster none")
    if mode == "in-cluster":
        return Source("in-cluster")
    found = [p for p in _kubeconfig_paths(kubeconfig, environ) if Path(p).is_file()]
    if mode == "kubeconfig":
        if not found:
            raise ClusterReadError(f"--cluster kubeconfig: no kubeconfig at "
                                   f"{os.pathsep.join(_kubeconfig_paths(kubeconfig, environ))}")
        return Source("kubeconfig", os.pathsep.join(found), context)
    if found:
        return Source("kubeconfig", os.pathsep.join(found), context)
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return Source("in-cluster")
    return Source("none", why="no kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config) and not in a pod")


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace(source: Source, sa_namespace: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The namespace kubectl would apply an object without metadata.namespace to: the chosen
    context's `namespace` in the kubeconfig (files merged as kubectl merges them: the first to
    set current-context, or a context, wins), the pod's own namespace in a pod, else default."""
    if source.mode == "in-cluster":
        return sa_namespace.read_text().strip() if sa_namespace.is_file() else "default"
    if source.mode != "kubeconfig" or not source.kubeconfig:
        return "default"
    current = source.context
    contexts: dict[str, dict[str, Any]] = {}
    for path in source.kubeconfig.split(os.pathsep):
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise ClusterReadError(f"kubeconfig {path} is not a mapping")
        current = current or doc.get("current-context") or None
        for entry in doc.get("contexts") or []:
            if isinstance(entry, dict) and isinstance(entry.get("context"), dict):
                contexts.setdefault(str(entry.get("name")), entry["context"])
    return str((contexts.get(current or "") or {}).get("namespace") or "default")


def read_pools(source: Source, refs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any] | None]:
    """{(namespace, name): the TPUSyncPool, None when the cluster has none of that name}."""
    if source.mode == "none" or not refs:
        return {}
    return asyncio.run(_read(source, refs))


async def _read(source: Source, refs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any] | None]:
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.config.config_exception import ConfigException

    from .kube import ApiKube, KubeError

    cfg = client.Configuration()
    try:
        if source.mode == "in-cluster":
            config.load_incluster_config(client_configuration=cfg)
        else:
            await config.load_kube_config(config_file=source.kubeconfig, context=source.context,
                                          client_configuration=cfg)
    except ConfigException as e:
        raise ClusterReadError(f"{source.describe()}: {e}") from None
    async with client.ApiClient(configuration=cfg) as api:
        kube = ApiKube(api, timeout=15.0)
        out: dict[tuple[str, str], dict[str, Any] | None] = {}
        for namespace, name in refs:
            try:
                out[(namespace, name)] = await kube.get(POOL_API, "TPUSyncPool", namespace, name)
            except KubeError as e:
                raise ClusterReadError(f"reading TPUSyncPool {namespace}/{name} from {source.describe()} "
                                       f"({cfg.host}): {e}") from None
        return out
