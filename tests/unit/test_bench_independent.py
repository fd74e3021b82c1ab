"""bench/ runs without the test tree: what the benches share with the tests lives in harness/.

Every bench script is parsed (nothing is imported or run): no import of `tests` or of a module
under it, and no path into tests/ put together in code (a sys.path entry or a script to run).
Docstrings and comments may still name the tiers. The harness's modules are held to the first
rule too (import-linter's contract in pyproject.toml cannot see tests/'s folders without an
__init__.py, such as tests/sglang); the one path into tests/ they keep is llm-d's indexer build
(tests/llmd/build-indexer.sh, harness.llmd_indexer.BUILD_SCRIPT).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted((ROOT / "bench").glob("*.py"))
HARNESS = sorted((ROOT / "harness").glob("*.py"))


def uses_of_the_test_tree(source: str, *, paths: bool = True) -> list[str]:
    """What in `source` reaches into tests/: the imports of tests.*, and the string constants
    (docstrings aside) that are the path component "tests" or a path starting with "tests/"."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tests":
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif (paths and isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and (node.value == "tests" or node.value.startswith(("tests/", "./tests/")))):
            found.append(f"line {node.lineno}: path {node.value!r}")
    return found


@pytest.mark.parametrize("script", BENCHES, ids=[p.name for p in BENCHES])
def test_bench_script_needs_nothing_from_tests(script: Path) -> None:
    uses = uses_of_the_test_tree(script.read_text())
    assert not uses, (f"bench/{script.name} reaches into tests/ ({'; '.join(uses)}): move what it needs into "
                      "harness/ and import it from there")


@pytest.mark.parametrize("module", HARNESS, ids=[p.name for p in HARNESS])
def test_harness_module_imports_nothing_from_tests(module: Path) -> None:
    uses = uses_of_the_test_tree(module.read_text(), paths=False)
    assert not uses, f"harness/{module.name} imports from tests/ ({'; '.join(uses)}): bench/ would need the test tree"


def test_benches_and_harness_are_found() -> None:
    assert len(BENCHES) >= 10, BENCHES
    assert len(HARNESS) >= 20, HARNESS


@pytest.mark.parametrize("source", [
    "from tests.support.fabric import Fabric\n",
    "import tests.llmd.conftest as c\n",
    "def f():\n    from tests.sglang.conftest import make_pool\n",
    "import sys\nsys.path.insert(0, str(ROOT / 'tests' / 'tpu_inference'))\n",
    "run(['bash', 'tests/llmd/build-indexer.sh'])\n",
])
def test_the_check_finds_each_way_in(source: str) -> None:
    assert uses_of_the_test_tree(source)


def test_docstrings_and_other_names_pass() -> None:
    source = ('"""Built as tests/llmd/conftest.py builds them."""\n'
              'from harness.llmd_fleet import Cluster\nimport testsuite\nx = "contests"\n')
    assert uses_of_the_test_tree(source) == []
