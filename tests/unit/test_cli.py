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
