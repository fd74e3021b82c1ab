"""harness.polling.wait_for: the one polling helper, with the options its callers use."""

from __future__ import annotations

import pytest

from harness.polling import WaitTimeout, wait_for


def counter(ready_at: int):
    calls = []

    def check() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= ready_at else 0

    return check, calls


def test_returns_the_first_truthy_value():
    check, calls = counter(3)
    assert wait_for("three calls", check, 5, interval=0) == 3
    assert len(calls) == 3


def test_times_out_naming_what_it_waited_for_and_the_last_error():
    def failing() -> bool:
        raise ValueError("indexer down")

    with pytest.raises(WaitTimeout, match=r"waiting for the index.*indexer down"):
        wait_for("the index", failing, 0, interval=0)


def test_step_runs_before_each_poll():
    steps: list[int] = []
    check, calls = counter(2)
    wait_for("two calls", check, 5, interval=0, step=lambda: steps.append(len(calls)))
    assert steps == [0, 1]  # each step came before its poll


def test_without_raising_it_returns_the_last_value_or_reraises_the_last_error():
    assert wait_for("never", list, 0, interval=0, raise_on_timeout=False) == []

    def failing() -> bool:
        raise ValueError("indexer down")

    with pytest.raises(ValueError, match="indexer down"):
        wait_for("never", failing, 0, interval=0, raise_on_timeout=False)
