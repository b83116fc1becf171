"""The engine thread's niceness by load (``stages.<stage>.saturated_nice`` / ``.saturated_calls``; no Ray).

Ray starts workers at nice 15 and its own threads at 0. Below saturation that is the right order on a shared CPU:
the engine thread of one stage yields to the next prompts' prefill and to the threads that deliver tokens, so first
tokens come early and the inter-token tail stays short. Once a stage's passes take many sessions' calls, its engine
is the bottleneck of every one of those streams, and each preemption of it delays them all: a saturated engine
runs at ``saturated_nice`` (0: as Ray's own threads), and goes back once its passes shrink (README, "Under load").
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def set_thread_nice(nice: int, when: str = "") -> bool:
    """The calling thread's niceness to ``nice`` (Linux: a thread's own). Where the process may not lower it (no
    CAP_SYS_NICE or RLIMIT_NICE), log why and return False: the thread stays where it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # (0: the calling thread)
    except OSError as exc:
        logger.warning("the engine thread stays at nice %d, not %d%s (%s): a niceness below the process's needs "
                       "CAP_SYS_NICE or RLIMIT_NICE", os.getpriority(os.PRIO_PROCESS, 0), nice, when, exc)
        return False
    return True


class EnginePriority:
    """Decides before each pass, on the event loop, whether the engine thread's niceness changes, and changes it on
    the engine thread (``apply``, submitted to its one-worker executor ahead of the pass).

    Saturated from a pass of ``saturated_calls`` calls on; back to ``base`` (the thread's niceness as it started)
    from a pass of fewer than half as many: the passes at request turnover, a few sessions short while the next
    prompts are prefilled, do not flip it back and forth.
    """

    def __init__(self, base: int, saturated_nice: int | None, saturated_calls: int):
        if saturated_calls < 1:
            raise ValueError(f"saturated_calls must be >= 1, got {saturated_calls}")
        self.base = base
        self.saturated_nice = saturated_nice if saturated_nice != base else None  # None: never changes
        self.saturated_calls = saturated_calls
        self.current = base  # the engine thread's niceness (as ``apply`` last set it)
        self.saturated = False  # (decided on the event loop; ``apply`` follows on the engine thread)
        self.switches = 0  # changes applied

    def for_pass(self, calls: int) -> int | None:
        """The niceness to switch the engine thread to before a pass of ``calls`` calls; None: it stays."""
        if self.saturated_nice is None:
            return None
        if not self.saturated and calls >= self.saturated_calls:
            self.saturated = True
            return self.saturated_nice
        if self.saturated and 2 * calls < self.saturated_calls:
            self.saturated = False
            return self.base
        return None

    def apply(self, nice: int) -> None:
        """On the engine thread: set its niceness (``set_thread_nice``); where that is refused, stop trying (it was
        logged once)."""
        if not set_thread_nice(nice, " under load"):
            self.saturated_nice, self.saturated = None, False
            return
        self.current = nice
        self.switches += 1
