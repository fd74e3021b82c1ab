"""Kubernetes' `$(VAR)` expansion, as the kubelet applies it to a container: what a process
started from a stored pod spec would see. For tests (the e2e suite's kwok plays the kubelet
and starts no container, so what a container would get is derived from the stored pod here).

A port of k8s.io/kubernetes v1.37.2 third_party/forked/golang/expansion/expand.go (`Expand`,
`MappingFuncFor`), which the kubelet applies
- to every `command` and `args` word, over the container's final environment
  (pkg/kubelet/container/helpers.go `ExpandContainerCommandAndArgs`, from
  pkg/kubelet/kuberuntime/kuberuntime_container.go);
- to every `env[].value`, over the variables defined before it (envFrom, then env in order)
  and the service variables (pkg/kubelet/kubelet_pods.go `makeEnvironmentVariables`);
  `valueFrom` values (Secrets, ConfigMaps, fields) are never expanded.
The rule: `$(NAME)` becomes NAME's value when NAME is defined and stays as written when not;
`$$` becomes `$`; any other `$` stays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def expand(value: str, variables: Mapping[str, str]) -> str:
    """`Expand(value, MappingFuncFor(variables))`."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(value):
        if value[cursor] == "$" and cursor + 1 < len(value):
            out.append(value[checkpoint:cursor])
            read, is_var, advance = _read_variable_name(value[cursor + 1:])
            out.append(variables.get(read, f"$({read})") if is_var else read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + value[checkpoint:]


def _read_variable_name(rest: str) -> tuple[str, bool, int]:
    """`tryReadVariableName`: (what was read, whether it is a variable name, characters used)."""
    if rest[0] == "$":                      # an escaped operator
        return "$", False, 1
    if rest[0] == "(":
        end = rest.find(")", 1)
        if end != -1:
            return rest[1:end], True, end + 1
        return "$(", False, 1               # an incomplete reference: kept
    return "$" + rest[0], False, 1          # an operator that opens no reference


def environment(container: Mapping[str, Any], value_from: Callable[[Mapping[str, Any]], str],
                initial: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container's environment: `initial` (envFrom's variables), then each `env` entry in
    order, a `value` expanded over the variables before it, a `valueFrom` resolved by
    `value_from` (given the entry's valueFrom) and not expanded."""
    env = dict(initial or {})
    for var in container.get("env") or []:
        if "valueFrom" in var:
            env[var["name"]] = value_from(var["valueFrom"])
        else:
            env[var["name"]] = expand(var.get("value", ""), env)
    return env


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The container's command and args, expanded over its environment."""
    return [expand(word, env) for word in [*(container.get("command") or []), *(container.get("args") or [])]]
