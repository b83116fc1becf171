"""deployments.priority: the engine thread's niceness by load — when it changes (with hysteresis), that the change
lands on the thread that applies it and on no other, and that a refused change is logged once and given up."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments import priority
from deployments.priority import EnginePriority


def test_saturated_from_the_threshold_on_and_back_below_half_of_it():
    p = EnginePriority(base=15, saturated_nice=0, saturated_calls=16)
    assert [p.for_pass(calls) for calls in (1, 8, 15)] == [None] * 3
    assert p.for_pass(16) == 0
    assert [p.for_pass(calls) for calls in (32, 12, 8, 16)] == [None] * 4  # turnover passes do not flip it
    assert p.for_pass(7) == 15
    assert p.for_pass(7) is None and p.for_pass(16) == 0


def test_nothing_changes_without_a_saturated_niceness_or_when_it_is_the_base():
    for p in (EnginePriority(15, None, 2), EnginePriority(0, 0, 2)):
        assert [p.for_pass(calls) for calls in (1, 2, 64, 1)] == [None] * 4
    with pytest.raises(ValueError, match="saturated_calls"):
        EnginePriority(15, 0, 0)


def test_apply_sets_the_calling_threads_niceness_only():
    """Raising the niceness needs no privilege: the engine thread goes to base + 1 and back; the caller's stays."""
    with ThreadPoolExecutor(max_workers=1) as engine:
        base = engine.submit(os.getpriority, os.PRIO_PROCESS, 0).result()
        if base >= 19:
            pytest.skip("this process already runs at nice 19")
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        p = EnginePriority(base, base + 1, 2)
        engine.submit(p.apply, p.for_pass(2)).result()
        assert engine.submit(os.getpriority, os.PRIO_PROCESS, 0).result() == base + 1 == p.current
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
        engine.submit(p.apply, p.for_pass(0)).result()
        assert engine.submit(os.getpriority, os.PRIO_PROCESS, 0).result() == base == p.current
        assert p.switches == 2


def test_a_refused_change_is_logged_and_given_up(monkeypatch, caplog):
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    p = EnginePriority(15, 0, 2)
    with caplog.at_level("WARNING", logger=priority.logger.name):
        p.apply(p.for_pass(4))
    assert "CAP_SYS_NICE" in caplog.text and (p.current, p.switches) == (15, 0)
    assert [p.for_pass(calls) for calls in (4, 0, 4)] == [None] * 3  # (no further tries)
