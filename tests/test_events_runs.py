"""Event bodies that queue up behind the events thread are applied as one run (issue 28,
item 1: ``service/events_thread.py``, ``event_source.decode_and_apply_run``).

- ``EventsThread``: one FIFO for every task; only consecutive tasks of one group share a run,
  within its bounds; a cancelled task is not run; each task gets its own result or error.
- ``decode_and_apply_run`` over random runs against the same bodies one at a time: the same answer for
  every body (report, or the error's type and text) and the same directory (every answer a
  client can ask for), over workloads with bad JSON, invalid fields, foreign instances (403),
  a bound on tracked instances that new instances hit mid-run (429), duplicates, stale and
  fenced batches, deletes.
- A prepare step (an event body's nogil split) runs on its own thread while the events thread
  is busy, and the group gets its result last (None when it raised); runs given prepared
  bodies answer and leave what one by one does.
- Through the app: bodies posted while the events thread is busy are answered each with
  its own reply, from one run; a large body is split on the prepare thread.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.service.app import create_app
from blendmatch.service.config import ServiceConfig
from blendmatch.index.wire_scan import EntrySplit
from blendmatch.service.event_source import PREPARE_MIN_BYTES, decode_and_apply_run, prepare_body
from blendmatch.service.events_thread import EventsThread

from ckpt_workload import C, answers, workload


# ---------------------------------------------------------------------- the thread
def _grouper(log: list):
    def group(args_list):
        log.append([a[0] for a in args_list])
        return [ValueError(f"bad {a[0]}") if a[0] < 0 else a[0] * 10 for a in args_list]
    return group


def test_one_fifo_runs_only_consecutive_tasks_of_a_group_within_bounds() -> None:
    runs: list = []
    other: list = []
    group, group2 = _grouper(runs), _grouper(other)
    t = EventsThread(max_run=3, max_run_bytes=100)
    gate = threading.Event()
    order: list = []
    try:
        first = t.submit(gate.wait)  # keeps the thread busy while the queue fills
        futs = [t.submit_grouped(group, (k,), 10) for k in range(1, 6)]  # 5 tasks: runs of 3 and 2
        call = t.submit(order.append, "call")  # a barrier: nothing after it joins an earlier run
        futs += [t.submit_grouped(group, (6,), 60), t.submit_grouped(group, (7,), 60)]  # bytes: two runs
        futs += [t.submit_grouped(group2, (8,), 1), t.submit_grouped(group, (-9,), 1)]  # another group; an error
        gate.set()
        assert first.result(10) is True
        assert [f.result(10) for f in futs[:7]] + [futs[7].result(10)] == [10, 20, 30, 40, 50, 60, 70, 80]
        with pytest.raises(ValueError, match="bad -9"):
            futs[8].result(10)
        call.result(10)
        assert runs == [[1, 2, 3], [4, 5], [6], [7], [-9]] and other == [[8]]
        assert t.runs == 6 and t.runs_tasks == 9
    finally:
        t.shutdown()
    assert t.pending == 0


def test_a_cancelled_task_is_not_run_and_a_failing_group_fails_its_run_only() -> None:
    seen: list = []

    def group(args_list):
        seen.extend(a[0] for a in args_list)
        if "boom" in [a[0] for a in args_list]:
            raise RuntimeError("group broke")
        return [a[0] for a in args_list]

    t = EventsThread()
    gate = threading.Event()
    try:
        t.submit(gate.wait)
        a = t.submit_grouped(group, ("a",), 1)
        b = t.submit_grouped(group, ("b",), 1)
        assert b.cancel()
        c = t.submit_grouped(group, ("c",), 1)
        gate.set()
        assert a.result(10) == "a" and c.result(10) == "c" and b.cancelled()
        assert seen == ["a", "c"]
        gate.clear()
        t.submit(gate.wait)
        d = t.submit_grouped(group, ("boom",), 1)
        e = t.submit_grouped(group, ("e",), 1)
        f = t.submit(lambda: "after")
        gate.set()
        for fut in (d, e):
            with pytest.raises(RuntimeError, match="group broke"):
                fut.result(10)
        assert f.result(10) == "after"
    finally:
        t.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        t.submit(lambda: None)


def test_shutdown_runs_everything_already_submitted() -> None:
    done: list = []
    t = EventsThread()
    gate = threading.Event()
    t.submit(gate.wait)
    futs = [t.submit_grouped(lambda xs: [done.append(x[0]) or x[0] for x in xs], (k,), 1) for k in range(20)]
    threading.Timer(0.05, gate.set).start()
    t.shutdown(wait=True)
    assert done == list(range(20)) and all(f.done() for f in futs)


def test_a_prepare_step_runs_ahead_on_its_own_thread_and_its_result_comes_last() -> None:
    seen: list = []

    def group(args_list):
        seen.extend(args_list)
        return [a[0] for a in args_list]

    def prepare(x):
        if x == "boom":
            raise RuntimeError("prepare broke")
        return (x, threading.current_thread().name)

    t = EventsThread(thread_name_prefix="tst-events")
    gate = threading.Event()
    try:
        t.submit(gate.wait)  # the events thread is busy: the prepare steps must not wait for it
        futs = [t.submit_grouped(group, (x,), 1, prepare) for x in ("a", "boom")]
        futs.append(t.submit_grouped(group, ("plain",), 1))
        for _ in range(500):
            if all(f.prepared.done() for f in t._queue if f.prepared is not None):
                break
            threading.Event().wait(0.01)
        assert [q.prepared is not None and q.prepared.done() for q in t._queue] == [True, True, False]
        gate.set()
        assert [f.result(10) for f in futs] == ["a", "boom", "plain"]
        assert seen == [("a", ("a", "tst-events-prepare_0")), ("boom", None), ("plain",)]
    finally:
        gate.set()
        t.shutdown()
    assert t._prepare is None and t.pending == 0


def test_awaited_tasks_are_answered_on_their_loop_one_callback_per_run() -> None:
    """``run_grouped`` / ``run`` from an event loop: each caller gets its own answer or
    error, a caller that gave up before its task ran is not run, and a run's answers reach
    the loop together; a loop that closed with a task in flight does not stop the thread."""
    seen: list = []

    def group(args_list):
        seen.append([a[0] for a in args_list])
        return [ValueError(f"bad {a[0]}") if a[0] < 0 else a[0] * 10 for a in args_list]

    t = EventsThread()
    gate = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        callbacks: list = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            callbacks.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        blocker = asyncio.ensure_future(t.run(gate.wait))
        await asyncio.sleep(0.05)  # the thread is now waiting on the gate
        calls = [asyncio.ensure_future(t.run_grouped(group, (k,), 1)) for k in (1, 2, -3, 4, 5)]
        await asyncio.sleep(0)  # every task queued
        calls[3].cancel()
        await asyncio.sleep(0)
        before = len(callbacks)
        gate.set()
        assert await blocker is True
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert results[:3] == [10, 20, results[2]] and isinstance(results[2], ValueError)
        assert str(results[2]) == "bad -3" and isinstance(results[3], asyncio.CancelledError) and results[4] == 50
        assert seen == [[1, 2, -3, 5]]  # one run, the cancelled task left out
        assert len(callbacks) - before == 2  # the blocker's answer, then the run's, in one callback
        assert await t.run(lambda: "plain") == "plain"

    try:
        asyncio.run(main())
        gate.clear()
        fut_loop = asyncio.new_event_loop()

        async def leave_one_in_flight() -> None:
            asyncio.ensure_future(t.run(gate.wait))
            await asyncio.sleep(0.05)

        fut_loop.run_until_complete(leave_one_in_flight())
        fut_loop.close()  # its task's answer has nowhere to go
        gate.set()
        assert t.submit_grouped(group, (8,), 1).result(10) == 80  # the thread went on
    finally:
        gate.set()
        t.shutdown()
    assert t.pending == 0


# ---------------------------------------------------------------------- runs vs one by one
def _directory() -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    return d


def _bodies(seed: int) -> list[tuple[bytes, object]]:
    """Workload batches as bodies of 1-3 batches each, with bad bodies mixed in, and new
    instances appearing late (so a bound on tracked instances is hit mid-run)."""
    rng = random.Random(seed)
    batches = workload(seed, 160)
    late = [dict(b, instance_id=f"late-{k}", seq=1) for k, b in enumerate(batches[-8:])]
    batches = batches[:-8]
    for b in late:
        batches.insert(rng.randrange(len(batches) // 2, len(batches) + 1), b)
    out: list[tuple[bytes, object]] = []
    i = 0
    while i < len(batches):
        k = rng.randrange(1, 4)
        body = json.dumps({"batches": batches[i:i + k]}).encode()
        i += k
        r = rng.random()
        if r < 0.04:
            body = body[: len(body) // 2]  # not JSON
        elif r < 0.08:
            body = body.replace(b'"seq"', b'"sequence"', 1)  # invalid: seq missing
        elif r < 0.10:
            body = b""
        may_act_for = None
        if rng.random() < 0.1:
            allowed = rng.choice(sorted({b["instance_id"] for b in batches}))
            may_act_for = (lambda a: lambda inst: inst == a)(allowed)  # 403 unless it names only that one
        out.append((body, may_act_for))
    return out


def _answer(x: object) -> object:
    if isinstance(x, Exception):
        return (type(x).__name__, str(x))
    return x


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_instances", [None, 4])
@pytest.mark.parametrize("prepared", [False, True])
def test_runs_answer_and_leave_what_one_by_one_does(seed: int, max_instances: int | None, prepared: bool) -> None:
    bodies = _bodies(seed)
    if prepared:  # the runs get each body's prepare step (split ahead, as on the prepare thread)
        split = [body + (prepare_body(*body),) for body in bodies]
        assert any(isinstance(b[2], EntrySplit) for b in split)
    one = _directory()
    want = []
    for body in bodies:  # one at a time: every body its own run
        want.extend(decode_and_apply_run(one, [body], max_instances))
    runs = _directory()
    got = []
    rng = random.Random(seed + 100)
    i = 0
    while i < len(bodies):
        k = rng.randrange(1, 12)
        got.extend(decode_and_apply_run(runs, (split if prepared else bodies)[i:i + k], max_instances))
        i += k
    assert [_answer(g) for g in got] == [_answer(w) for w in want]
    kinds = {type(w).__name__ for w in want}
    assert {"ApplyReport", "RequestValidationError", "EventValidationError", "Forbidden"} <= kinds, kinds
    if max_instances is not None:
        assert "TooManyInstances" in kinds  # the late instances hit the bound, some inside a run
    assert answers(runs, seed) == answers(one, seed)


# ---------------------------------------------------------------------- through the app
def _store_body(instance: str, seq: int, first: int, n: int) -> bytes:
    entries = [{"key": {"chunk_hash_hex": (first + i).to_bytes(16, "big").hex(), "model_name": "m",
                        "kv_rank": 1 << 24, "object_group_id": 0, "cache_salt": ""},
                "size_bytes": 1024, "token_offset": 0, "token_ids": [(first + i) % 1000] + list(range(C - 1))}
               for i in range(n)]
    return json.dumps({"batches": [{"instance_id": instance, "incarnation": 0, "seq": seq, "event_type": "store",
                                    "tier": "l1", "backend": "LocalCPUBackend", "entries": entries}]}).encode()


def test_bodies_posted_while_the_events_thread_is_busy_are_one_run_each_answered() -> None:
    async def main() -> None:
        app = create_app(ServiceConfig(chunk_size=C, engine="reference", host="127.0.0.1"))
        async with app.router.lifespan_context(app):
            ctx = app.state.blendmatch_context
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                gate = threading.Event()
                busy = asyncio.ensure_future(ctx.run_event_task(gate.wait))
                posts = [asyncio.ensure_future(client.post(
                    "/events", content=_store_body(f"p{k}", 1, 100 * k, 3), headers={"content-type": "application/json"}))
                    for k in range(5)]
                posts.append(asyncio.ensure_future(client.post(
                    "/events", content=b'{"batches": [{"instance_id": "bad"}]}',
                    headers={"content-type": "application/json"})))
                events = ctx._events_thread
                for _ in range(500):  # every body queued behind the busy thread
                    if events.pending == 7:
                        break
                    await asyncio.sleep(0.01)
                assert events.pending == 7
                runs_before = events.runs
                gate.set()
                await busy
                replies = await asyncio.gather(*posts)
                assert [r.status_code for r in replies] == [200] * 5 + [422]
                assert [r.json()["entries_applied"] for r in replies[:5]] == [3] * 5
                assert "body.batches.0" in replies[5].text  # its own validation error, naming the field
                assert events.runs == runs_before + 1  # the six bodies: one run
                assert ctx.directory.stats()["num_keys"] == 15
    asyncio.run(main())


def test_a_large_body_is_split_on_the_prepare_thread_and_answered_the_same() -> None:
    async def main() -> None:
        app = create_app(ServiceConfig(chunk_size=C, engine="reference", host="127.0.0.1"))
        async with app.router.lifespan_context(app):
            ctx = app.state.blendmatch_context
            events = ctx._events_thread
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                small = _store_body("p0", 1, 0, 3)
                r = await client.post("/events", content=small, headers={"content-type": "application/json"})
                assert r.status_code == 200 and events._prepare is None  # small: split on the events thread
                n = 1
                while len(_store_body("p1", 1, 1000, n)) < PREPARE_MIN_BYTES:
                    n *= 2
                r = await client.post("/events", content=_store_body("p1", 1, 1000, n),
                                      headers={"content-type": "application/json"})
                assert r.status_code == 200 and r.json()["entries_applied"] == n
                assert events._prepare is not None  # the prepare thread ran its split
                assert ctx.directory.stats()["num_keys"] == 3 + n
    asyncio.run(main())
