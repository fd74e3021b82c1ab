"""Every command line: --help does nothing else, input is checked before work, errors are one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tpusync.weights.__main__ import main as weights_main


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("module", ["tpusync.demo", "tpusync.weights", "tpusync.serving", "tpusync_operator"])
def test_help_prints_and_exits(module):
    done = run("-m", module, "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr
    assert "Traceback" not in done.stderr


def test_operator_help_lists_render():
    assert "render FILE" in run("-m", "tpusync_operator", "--help").stdout


@pytest.mark.parametrize("flag, value", [("--link-gb-per-s", "0"), ("--hosts", "-2"), ("--params-b", "x")])
def test_numbers_are_checked_while_parsing(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        weights_main(["plan", flag, value])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the usage, one line
    assert last.startswith(f"python -m tpusync.weights plan: error: argument {flag}: "), last


def test_an_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    args = ["-m", "tpusync.weights", "receive", f"--control-socket={tmp_path / 'none.sock'}", "--host=h:1",
            "--model=m", "--version=1", "--source=s:1", "--destination=h:1"]
    done = run(*args)
    assert done.returncode == 1
    assert done.stderr.startswith("python -m tpusync.weights: error: ") and len(done.stderr.splitlines()) == 1
    debug = run(*args, "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


RECEIVE = ["receive", "--control-socket=/nonexistent/control.sock", "--model=m"]


@pytest.mark.parametrize("args, message", [
    (["--version=1", "--host=a:1", "--source=s:1", "--source=s:1", "--destination=a:1"],
     "--source s:1 is given twice"),
    (["--version=1", "--host=a:1", "--source=s:1", "--destination=a:1", "--destination=a:1"],
     "--destination a:1 is given twice"),
    (["--version=1", "--host=c:1", "--source=s:1", "--destination=a:1"],
     "--host c:1 is not one of the --destination ['a:1']"),
    (["--version=1", "--host=s:1", "--source=s:1", "--destination=s:1"], "--host s:1 is one of the --source"),
    (["--version=1", "--host=a:99999", "--source=s:1", "--destination=a:1"], "--host 'a:99999' is not host:port"),
    (["--version=0", "--host=a:1", "--source=s:1", "--destination=a:1"],
     "argument --version: version must be an integer >= 1, not 0"),
    (["--version=-1", "--host=a:1", "--source=s:1", "--destination=a:1"],
     "argument --version: version must be an integer >= 1, not -1"),
    (["--version=x", "--host=a:1", "--source=s:1", "--destination=a:1"], "argument --version: 'x' is not an integer"),
])
def test_receive_checks_every_argument_while_parsing(capsys, args, message):
    """Refused as a usage error before the control socket is even opened (it does not exist: the
    old receiver got that far, or with a socket, waited out --timeout-seconds for the manifest)."""
    with pytest.raises(SystemExit) as e:
        weights_main(RECEIVE + args)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m tpusync.weights receive: error: ") and message in last, last
