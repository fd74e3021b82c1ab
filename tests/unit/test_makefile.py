"""System packages per make target: each target installs what it needs, `make demo` nothing of
the tests' (it used to install an SSH server, sshfs, iptables and clang: on a systemd
workstation, a running sshd to see a demo), and `make test` still everything, up front.

Read from `make -n` (a dry run: the install recipes are printed, not run): the package lists
are those each recipe would ask dpkg about and install when missing."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# ccache: every C++ build's compiler launcher (the Makefile exports it), so the demo's too.
NATIVE_BUILD = {"g++", "cmake", "ninja-build", "ccache", "libxxhash-dev", "libssl-dev", "libipsec-mb-dev"}
TESTS_ONLY = {"openssh-server", "sshfs", "iptables", "iproute2", "clang-14", "libclang-rt-14-dev", "clang-tidy-14",
              "libgtest-dev"}


def installs(*targets: str) -> list[set[str]]:
    """The package list of every install recipe `make TARGETS` would run, in order."""
    out = subprocess.run(["make", "--no-print-directory", "-n", *targets], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return [set(m.split()) for m in re.findall(r"for p in ([^;]*); do dpkg -s", out)]


@pytest.mark.parametrize("target", ["demo", "install"])
def test_the_demo_installs_the_native_build_only(target):
    assert installs(target) == [NATIVE_BUILD]


@pytest.mark.parametrize("target, needs", [
    ("native-test", {"libgtest-dev"}),
    ("fuzz", {"clang-14", "libclang-rt-14-dev"}),
    ("build/lint/clang-tidy.ok", {"clang-tidy-14", "libgtest-dev"}),
    ("pytest", {"iproute2", "iptables", "sshfs", "openssh-server"}),
])
def test_each_test_target_installs_what_it_uses(target, needs):
    """Of the tests' packages, each target installs exactly those it uses (beside the native build)."""
    got = set().union(*installs(target))
    assert got - NATIVE_BUILD == needs


def test_make_test_installs_every_package_first():
    """`make test` on a fresh machine (CI's .ci/run): its first install is every package the
    targets after it would install, so no tier meets a missing tool half-way."""
    first, *rest = installs("test")
    every = set().union(*installs("native-test", "fuzz", "build/lint/clang-tidy.ok", "pytest", "demo"))
    assert every <= first, sorted(every - first)
    assert all(r <= first for r in rest if r & (NATIVE_BUILD | TESTS_ONLY))
