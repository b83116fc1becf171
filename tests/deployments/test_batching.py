"""ContinuousBatcher: who joins which pass (pure asyncio, a fake pass that records its calls).

The tests wait for states, not for time: "a pass is running" is ``running(engine)`` (its calls recorded), and a pass
that must outlast the calls arriving during it holds until the test opens its gate."""

import asyncio
from dataclasses import dataclass

import pytest

from deployments.batching import ContinuousBatcher


@dataclass(frozen=True)
class Call:
    request_id: str
    rows: int = 2


class Engine:
    """A pass that takes ``seconds`` and records the request ids of each pass."""

    def __init__(self, seconds: float = 0.05, fail: set[str] = frozenset(), crash: bool = False, gated: bool = False):
        self.passes: list[list[str]] = []
        self.seconds, self.fail, self.crash = seconds, fail, crash
        self.gate = asyncio.Event() if gated else None  # gated: every pass holds until the gate opens

    async def run_pass(self, calls):
        self.passes.append([c.request_id for c in calls])
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.seconds)
        if self.crash:
            raise RuntimeError("pass failed")
        return [ValueError(f"bad {c.request_id}") if c.request_id in self.fail else f"ok {c.request_id}" for c in calls]


def run(coro):
    return asyncio.run(coro)


async def running(engine: Engine, passes: int = 1) -> None:
    """Until ``passes`` passes have started."""
    while len(engine.passes) < passes:
        await asyncio.sleep(0)


async def queued(tasks: list) -> None:
    """Let new submit tasks run up to their wait (each call is in the queue then)."""
    for _ in range(len(tasks) + 1):
        await asyncio.sleep(0)


def during_a_pass(engine: Engine, calls: list[Call], max_rows: int = 32) -> list:
    """Submit "a", then ``calls`` while its pass runs (held until they queued); every result (or exception) in
    order, "a"'s first."""
    engine.gate = asyncio.Event()

    async def main():
        batcher = ContinuousBatcher(engine.run_pass, max_rows=max_rows)
        first = asyncio.create_task(batcher.submit(Call("a")))
        await running(engine)
        rest = [asyncio.create_task(batcher.submit(call)) for call in calls]
        await queued(rest)
        engine.gate.set()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    return run(main())


def test_a_lone_call_starts_at_once():
    """No batching window: the pass starts within a few event-loop turns of the call, before any timer could fire."""
    engine = Engine(seconds=0.0)

    async def main():
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32)
        call = asyncio.create_task(batcher.submit(Call("a")))
        for _ in range(3):  # submit, then the drain task, then its pass: no sleep with a delay in between
            await asyncio.sleep(0)
        started = list(engine.passes)
        return started, await call

    started, result = run(main())
    assert started == [["a"]]
    assert result == "ok a" and engine.passes == [["a"]]


def test_calls_arriving_during_a_pass_join_the_next_one():
    engine = Engine()
    assert during_a_pass(engine, [Call(name) for name in "bcd"]) == ["ok a", "ok b", "ok c", "ok d"]
    assert engine.passes == [["a"], ["b", "c", "d"]]


def test_a_pass_takes_at_most_max_rows_and_one_call_per_session():
    engine = Engine()
    results = during_a_pass(engine, [Call("b"), Call("b"), Call("c"), Call("d"), Call("big", rows=9)], max_rows=5)
    assert results == ["ok a", "ok b", "ok b", "ok c", "ok d", "ok big"]
    # 2 + 2 rows fit in 5; "b" again waits for a pass of its own session's next turn; a call larger than
    # max_rows runs (alone) rather than never
    assert engine.passes == [["a"], ["b", "c"], ["b", "d"], ["big"]]


def test_errors_reach_only_their_callers():
    a, b, c = during_a_pass(Engine(fail={"b"}), [Call("b"), Call("c")])
    assert a == "ok a" and c == "ok c"
    assert isinstance(b, ValueError) and "bad b" in str(b)


def test_a_failed_pass_fails_its_calls_and_the_batcher_goes_on():
    engine = Engine(crash=True)

    async def main():
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32)
        with pytest.raises(RuntimeError, match="pass failed"):
            await batcher.submit(Call("a"))
        engine.crash = False
        return await batcher.submit(Call("b"))

    assert run(main()) == "ok b"


def test_a_cancelled_caller_is_dropped_from_the_queue():
    engine = Engine()

    async def main():
        engine.gate = asyncio.Event()
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32)
        first = asyncio.create_task(batcher.submit(Call("a")))
        await running(engine)
        gone = asyncio.create_task(batcher.submit(Call("gone")))
        kept = asyncio.create_task(batcher.submit(Call("kept")))
        await queued([gone, kept])
        gone.cancel()
        engine.gate.set()
        return await asyncio.gather(first, kept)

    assert run(main()) == ["ok a", "ok kept"]
    assert engine.passes == [["a"], ["kept"]]


def test_sessions_answered_by_a_pass_come_back_into_one_pass():
    """After a pass the batcher waits briefly for the sessions it answered (a hop away), so the passes do not settle
    into alternating half-batches."""
    engine = Engine(seconds=0.05)

    async def session(batcher, name, delay):
        await asyncio.sleep(delay)
        for _ in range(4):
            await batcher.submit(Call(name))
            await asyncio.sleep(0.005)  # the hop back to the caller and its next call

    async def late(batcher, name):  # starts once "a"'s first pass runs
        await running(engine)
        await session(batcher, name, 0.0)

    async def main():
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32, gather_fraction=2.0, gather_max_s=1.0)
        await asyncio.gather(session(batcher, "a", 0.0), late(batcher, "b"), late(batcher, "c"))

    run(main())
    assert engine.passes[0] == ["a"]
    assert sorted(engine.passes[1]) == ["a", "b", "c"]  # "a" came back and joined "b" and "c"
    assert all(sorted(p) == ["a", "b", "c"] for p in engine.passes[1:-1])


def test_a_closed_session_is_not_waited_for():
    engine = Engine(seconds=0.05)

    async def main():
        engine.gate = asyncio.Event()
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32, gather_fraction=100.0, gather_max_s=30.0)
        first = asyncio.create_task(batcher.submit(Call("a")))
        await running(engine)
        second = asyncio.create_task(batcher.submit(Call("b")))
        await queued([second])
        engine.gate.set()
        await first
        batcher.forget("a")  # "a" closed: "b" need not wait for it
        return await asyncio.wait_for(second, timeout=5.0)

    assert run(main()) == "ok b"
    assert engine.passes == [["a"], ["b"]]


def test_an_expected_session_joins_the_next_pass():
    """A session being opened (``expect``) makes its first call a moment after a pass ends: that pass's successor
    waits for it, as for the sessions the pass answered, rather than leaving it a whole pass behind."""
    engine = Engine(seconds=0.05)

    async def main():
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32, gather_fraction=1.0, gather_max_s=1.0)
        first = asyncio.create_task(batcher.submit(Call("a")))
        await running(engine)
        batcher.expect("new")  # its open runs after "a"'s pass ...
        await first
        await asyncio.sleep(0.01)  # ... and takes a while
        return await asyncio.gather(batcher.submit(Call("new")), batcher.submit(Call("a")))

    assert run(main()) == ["ok new", "ok a"]
    assert engine.passes == [["a"], ["new", "a"]]


def test_an_expected_session_that_closes_before_its_first_call_is_not_waited_for():
    engine = Engine(seconds=0.02)

    async def main():
        batcher = ContinuousBatcher(engine.run_pass, max_rows=32, gather_fraction=100.0, gather_max_s=30.0)
        batcher.expect("gone")
        await batcher.submit(Call("a"))
        batcher.forget("gone")  # its open failed, or its stream was cancelled
        return await asyncio.wait_for(batcher.submit(Call("a")), timeout=5.0)

    assert run(main()) == "ok a"
    assert engine.passes == [["a"], ["a"]]
