"""python/tpusync/_native.pyi against the built extension: the same names, and the same
parameter names for every function (pybind11 writes them into each docstring's signature)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tpusync import _native

STUB = Path(_native.__file__).parent / "_native.pyi"
if not STUB.exists():  # an editable install redirects the module; the stub stays in the source tree
    STUB = Path(__file__).resolve().parents[3] / "python" / "tpusync" / "_native.pyi"
ALIASES = {"Buffer", "Keys"}  # type aliases the stub defines for its signatures
TYPING_ONLY = {"__buffer__"}  # the buffer protocol, C-level in the module


def _stub() -> dict[str, dict[str, list[str] | None] | list[str] | None]:
    """name -> parameter names (functions), {member -> parameter names or None} (classes), None."""
    out: dict[str, dict[str, list[str] | None] | list[str] | None] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members: dict[str, list[str] | None] = {}
            for m in node.body:
                if isinstance(m, ast.FunctionDef):
                    members[m.name] = _params(m)
                elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                    members[m.target.id] = None
            out[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = _params(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name) and t.id not in ALIASES:
                    out[t.id] = None
    return out


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.arg != "self"]


def _real_params(obj: object) -> list[str] | None:
    """Parameter names from pybind11's docstring signature `name(self: T, a: int, *, b: str) -> R`."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    m = re.match(r"^\w+\((.*?)\) ->", doc.splitlines()[0] if doc else "")
    if m is None:
        return None  # overloaded or not a pybind11 function
    names = [p.split(":")[0].strip() for p in re.split(r",\s*(?![^\[]*\])", m.group(1)) if p.strip()]
    return [n for n in names if n not in ("self", "*", "/")]


def test_the_stub_names_what_the_module_has_and_nothing_else():
    stub = _stub()
    real = {n for n in dir(_native) if not n.startswith("__")}
    assert set(stub) == real


@pytest.mark.parametrize("cls", sorted(n for n, v in _stub().items() if isinstance(v, dict)))
def test_each_class_has_the_stubs_members(cls):
    members = _stub()[cls]
    assert isinstance(members, dict)
    obj = getattr(_native, cls)
    public = {n for n in dir(obj) if not n.startswith("_")}
    assert {n for n in members if not n.startswith("_")} == public
    assert [n for n in members if n.startswith("__") and n not in TYPING_ONLY and not hasattr(obj, n)] == []
    for name, params in members.items():
        if params is None or name in TYPING_ONLY:
            continue
        got = _real_params(getattr(obj, name))
        if got is not None:
            assert got == params, f"{cls}.{name}"
