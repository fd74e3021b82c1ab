"""Validate TPUSyncPool and DisaggregatedServing objects as the API server would, without a cluster.

The rules are the generated CRDs' own (crdgen.build_crd, which `make crds` writes to crds/):
the structural schema with its defaults, unknown fields refused (kubectl's default strict field
validation), and every `x-kubernetes-validations` CEL rule evaluated by Google's CEL runtime
(cel-expr-python, cel-cpp) with the Kubernetes quantity functions the rules use. Transition
rules (oldSelf) apply to updates only and are skipped, as the API server skips them on create.
e2e/test_crds.py holds the API server to the same corpus of invalid objects
(harness/invalid_objects.py) that tests/unit/operator/test_validate.py holds this to.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from typing import Any

from cel_expr_python import cel

from . import GROUP, VERSION
from .crdgen import KINDS, build_crd

API_VERSION = f"{GROUP}/{VERSION}"
# metadata.name of a namespaced custom resource: a DNS subdomain.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


# ------------------------------------------------------------------ CEL

_QUANTITY = re.compile(r"^(?P<num>[0-9]+(?:\.[0-9]+)?)(?P<suffix>[KMGTPE]i|[kMGTPE])?$")
_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _quantity_integer(text: str) -> int:
    """Kubernetes' quantity(s).asInteger(): the exact integer, an error when the quantity has a
    fraction or does not fit an int64 (k8s.io/apiserver pkg/cel/library/quantity.go)."""
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"invalid quantity {text!r}")
    value = Decimal(m["num"]) * _SUFFIX[m["suffix"] or ""]
    if value != value.to_integral_value() or value >= 2**63:
        raise ValueError(f"cannot convert quantity {text!r} to an integer")
    return int(value)


# quantity(s) is an integer here, and asInteger() the identity on it: the rules call only
# quantity(s).asInteger(), which the API server type-checks against its real Quantity type.
_FUNCTIONS = [
    cel.FunctionDecl("quantity", [cel.Overload("quantity_string", cel.Type.INT, [cel.Type.STRING],
                                               impl=_quantity_integer)]),
    cel.FunctionDecl("asInteger", [cel.Overload("quantity_asInteger", cel.Type.INT, [cel.Type.INT],
                                                is_member=True, impl=lambda q: q)]),
]


@cache
def _env() -> Any:
    from cel_expr_python.ext import ext_strings
    return cel.NewEnv(variables={"self": cel.Type.DYN, "oldSelf": cel.Type.DYN}, functions=_FUNCTIONS,
                      extensions=[ext_strings.ExtStrings()])


@cache
def _compiled(expression: str) -> Any:
    return _env().compile(expression)


def _evaluate(expression: str, value: Any) -> Any:
    result = _compiled(expression).eval(data={"self": value})
    if result.type() == cel.Type.ERROR:
        raise ValueError(str(result.value()))
    return result.value()


# ------------------------------------------------------------------ schema

def _type_error(schema: dict[str, Any], value: Any) -> str | None:
    kind = schema.get("type")
    ok: dict[str, Callable[[Any], bool]] = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    }
    if kind in ok and not ok[kind](value):
        return f"Invalid value: {type(value).__name__} {value!r}: must be of type {kind}"
    return None


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting: a missing property with a default gets it, recursively."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = _apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(schema["items"], v) for v in value]
    return value


def _cel_value(schema: dict[str, Any], value: Any) -> Any:
    """A value as CEL sees it: schema `number`s are doubles even when written as integers."""
    if schema.get("type") == "number" and isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return {k: _cel_value(props.get(k) or (extra if isinstance(extra, dict) else {}), v)
                for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_cel_value(schema["items"], v) for v in value]
    return value


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check(schema: dict[str, Any], value: Any, path: str, errors: list[FieldError]) -> bool:
    """Append every error of `value` under `schema`; False when its shape is wrong (a type
    mismatch or a missing required field below it), where its CEL rules cannot run."""
    problem = _type_error(schema, value)
    if problem:
        errors.append(FieldError(path, problem))
        return False
    sound = True
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        errors.append(FieldError(path, f"Unsupported value: {value!r}: supported values: {allowed}"))
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(FieldError(path, f"Invalid value: {value!r}: {path} in body should match "
                                           f"'{schema['pattern']}'"))
        if len(value) < schema.get("minLength", 0):
            errors.append(FieldError(path, f"Invalid value: {value!r}: {path} in body should be at least "
                                           f"{schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(FieldError(path, f"Too long: may not be more than {schema['maxLength']} bytes"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(FieldError(path, f"Invalid value: {value}: {path} in body should be greater than or "
                                           f"equal to {schema['minimum']}"))
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(FieldError(path, f"Invalid value: {value}: {path} in body should be less than or "
                                           f"equal to {schema['maximum']}"))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(FieldError(path, f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
        for i, item in enumerate(value):
            sound &= _check(schema.get("items", {}), item, f"{path}[{i}]", errors)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key in schema.get("required", []):
            if key not in value:
                errors.append(FieldError(_child(path, key), "Required value"))
                sound = False
        for key, item in value.items():
            if key in props:
                sound &= _check(props[key], item, _child(path, key), errors)
            elif isinstance(extra, dict):
                sound &= _check(extra, item, _child(path, key), errors)
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(FieldError(_child(path, key), f'unknown field "{_child(path, key)}"'))
    if sound:
        _check_rules(schema, value, path, errors)
    return sound


def _check_rules(schema: dict[str, Any], value: Any, path: str, errors: list[FieldError]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue    # a transition rule: updates only
        try:
            passed = _evaluate(rule["rule"], _cel_value(schema, value))
        except ValueError as e:
            errors.append(FieldError(path, f"Invalid value: rule {rule['rule']!r} could not be evaluated: {e}"))
            continue
        if passed is not True:
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            if "messageExpression" in rule:
                with contextlib.suppress(ValueError):    # the static message then
                    message = str(_evaluate(rule["messageExpression"], _cel_value(schema, value)))
            errors.append(FieldError(path + (rule.get("fieldPath") or ""), f"Invalid value: \"object\": {message}"))


@cache
def _schema(kind: str) -> dict[str, Any]:
    crd = build_crd(kind)
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def validate(obj: dict[str, Any]) -> tuple[dict[str, Any], list[FieldError]]:
    """(the object with the CRD's defaults applied, every error in it); errors empty when the
    API server would accept it on create."""
    errors: list[FieldError] = []
    kind = obj.get("kind")
    if obj.get("apiVersion") != API_VERSION or kind not in KINDS:
        return obj, [FieldError("kind", f"{obj.get('apiVersion')}/{kind} is not a kind of {API_VERSION} "
                                        f"({', '.join(KINDS)})")]
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        errors.append(FieldError("metadata.name", "Required value: name or generateName is required"))
    elif len(name) > 253 or not _NAME.match(name):
        errors.append(FieldError("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain "
                                                  "(lowercase letters, digits, '-' and '.')"))
    schema = _schema(kind)
    body = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    body = _apply_defaults(schema, body)
    root = {**schema, "properties": {k: v for k, v in schema["properties"].items()
                                     if k not in ("apiVersion", "kind", "metadata", "status")}}
    if errors:      # no name: the root's rules, which read it, cannot run
        root.pop("x-kubernetes-validations", None)
        _check(root, body, "", errors)
    else:           # the root's rules see metadata.name (CEL sees only it and generateName of metadata)
        root["properties"]["metadata"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        _check(root, {**body, "metadata": {"name": name}}, "", errors)
    return {**obj, **body}, errors
