"""A stop that always stops: `splitspec serve` ends within a bound after Ctrl-C / SIGTERM, leaving nothing behind.

The first signal asks the main thread to stop gracefully (Serve drains and
deletes the app, then ``ray.shutdown()``). A watchdog thread enforces the bound:
on a second signal, or when the bound has passed, it ends the processes this
command started (by their ids) and exits the process at once.

The watchdog hears signals through ``signal.set_wakeup_fd``: CPython's C-level
handler writes the signal number there as it arrives, whereas a Python handler
runs only when the main thread gets back to the interpreter — never while it
is stuck in a C call (a blocking Ray RPC, a thread join at exit). So a second
Ctrl-C forces the stop even then.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import select
import signal
import socket
import sys
import threading
import time

import psutil

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_STOP_TIMEOUT_S = 30.0
TERM_GRACE_S = 2.0  # SIGTERM first, then SIGKILL after this long
EXIT_WAIT_S = 5.0  # after ray.shutdown(), how long Ray's processes get to exit on their own
SNAPSHOT_PERIOD_S = 2.0  # how often the watchdog records new child processes (replica workers come and go)
FORCED_EXIT_CODE = 1
END_ROUNDS = 5  # re-scans after ending: a process forked while the others were being ended is ended too
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


class OwnedProcesses:
    """The processes this command started: its descendants, remembered by id so that reparented ones are not lost.

    Ray's worker processes are children of the raylet. On Linux this process
    becomes a child subreaper, so when the raylet dies its workers are
    reparented to us, not to init, and stay our descendants — also one the
    raylet forked just before it was ended. Elsewhere, recording them while the
    tree is intact keeps them ours. ``psutil.Process`` checks the creation time,
    so a recycled pid is never taken for one of ours.
    """

    def __init__(self):
        self._me = psutil.Process()
        self._known: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        _become_subreaper()

    def snapshot(self) -> None:
        try:
            children = self._me.children(recursive=True)
        except psutil.Error:
            return
        with self._lock:
            for proc in children:
                self._known.setdefault(proc.pid, proc)

    def alive(self) -> list[psutil.Process]:
        self.snapshot()
        with self._lock:
            procs = list(self._known.values())
        return [p for p in procs if _running(p)]

    def end(self, grace_s: float = TERM_GRACE_S) -> list[str]:
        """SIGTERM every live one, SIGKILL what is left after ``grace_s``; return 'name(pid)' of those ended.

        Ends in rounds until a fresh scan finds none alive: a process can be forked (a raylet starting a worker)
        between the scan and the signal that ends its parent.
        """
        names = []
        for _ in range(END_ROUNDS):
            procs = self.alive()
            if not procs:
                break
            names += [_describe(p) for p in procs]
            for p in procs:
                _signal(p, signal.SIGTERM)
            _, still = psutil.wait_procs(procs, timeout=grace_s)
            for p in still:
                _signal(p, signal.SIGKILL)
            psutil.wait_procs(still, timeout=grace_s)
        return names


class Stopper:
    """Turns Ctrl-C / SIGTERM into a bounded stop. Install it in the main thread before starting anything.

        stopper = Stopper(timeout_s=30).install()
        ... start; stopper.requested.wait() ...
        stopper.begin()          # the bound starts (already started by a signal)
        ... graceful stop ...
        stopper.finish()         # end whatever of ours is still alive (the bound holds until exit)
    """

    def __init__(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S, *, out=None):
        self.timeout_s = timeout_s
        self.requested = threading.Event()  # a stop was asked for (signal, error, end of work)
        self.owned = OwnedProcesses()
        self._out = out or sys.stderr
        self._deadline: float | None = None
        self._signals = 0
        self._lock = threading.Lock()
        self._rsock, self._wsock = socket.socketpair()
        self._watchdog = threading.Thread(target=self._watch, name="splitspec-stop-watchdog", daemon=True)

    # -- main thread -----------------------------------------------------------------------------

    def install(self) -> "Stopper":
        """Own SIGINT / SIGTERM (call again after anything that replaces them, e.g. ``ray.init``)."""
        self._wsock.setblocking(False)
        signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        if not self._watchdog.is_alive():
            self._watchdog.start()
        return self

    def begin(self, why: str = "") -> None:
        """Start the bound (idempotent): from now on the process ends within ``timeout_s``."""
        self.requested.set()
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self.timeout_s
                self._say(f"stopping{f' ({why})' if why else ''}: within {self.timeout_s:g}s; Ctrl-C again forces it")

    def finish(self) -> list[str]:
        """After the graceful stop: give our processes a moment to exit, end the rest; return what was ended.

        The watchdog keeps guarding the bound until the process is gone (atexit handlers and thread joins run
        after this).
        """
        psutil.wait_procs(self.owned.alive(), timeout=EXIT_WAIT_S)
        left = self.owned.end()
        if left:
            self._say(f"ended {len(left)} leftover process(es): {', '.join(left)}")
        return left

    def _on_signal(self, signum, frame) -> None:  # Python-level handler: only records the request
        self.requested.set()

    # -- watchdog thread -------------------------------------------------------------------------

    def _watch(self) -> None:
        last_snapshot = 0.0
        while True:
            wait = SNAPSHOT_PERIOD_S
            if self._deadline is not None:
                wait = max(0.0, min(wait, self._deadline - time.monotonic()))
            ready, _, _ = select.select([self._rsock], [], [], wait)
            if ready:
                for signum in self._rsock.recv(64):
                    if signum in STOP_SIGNALS:
                        self._signals += 1
                        if self._signals == 1:
                            self.begin(f"{signal.Signals(signum).name} received")
                        else:
                            self._force(f"{signal.Signals(signum).name} received again")
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._force(f"not stopped after {self.timeout_s:g}s")
            if time.monotonic() - last_snapshot >= SNAPSHOT_PERIOD_S:
                self.owned.snapshot()
                last_snapshot = time.monotonic()

    def _force(self, why: str) -> None:
        self._say(f"forcing the stop: {why}; where each thread was:")
        try:  # where the graceful stop hung, for the log
            faulthandler.dump_traceback(file=self._out, all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass
        left = self.owned.end(grace_s=0.5)
        if left:
            self._say(f"ended {len(left)} process(es): {', '.join(left)}")
        os._exit(FORCED_EXIT_CODE)

    def _say(self, text: str) -> None:
        try:
            print(text, file=self._out, flush=True)
        except (OSError, ValueError):
            pass


def _become_subreaper() -> None:
    """Orphaned descendants are reparented to this process instead of init (Linux only; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_CHILD_SUBREAPER) unavailable; orphaned workers are found by earlier snapshots")


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.name()}({p.pid})"
    except psutil.Error:
        return f"?({p.pid})"
