"""asyncio front of the engine.

One thread owns the ``Engine`` and runs its step loop; every mutation
(add, abort, reserve/commit external KV, lease release) is a command queued
to that thread and applied between steps, so the event loop never waits on
a forward pass and the engine needs no lock.  Outputs come back to each
request's ``asyncio.Queue`` through ``call_soon_threadsafe``.

No request can take the loop down: the engine fails a request whose logits
are not finite, or whose step raised, and goes on; that request's stream
raises RequestFailedError.  The loop dies only when the engine says it
cannot go on (EngineDeadError from ``step``), on a bug in the loop itself,
or on ``inject_fault("kill")``; then every waiter gets EngineDeadError,
``alive`` turns False and ``check_alive`` raises.  ``heartbeat_age_s`` tells
a stuck loop from a dead one: the seconds since the loop last finished a
turn (a step, or an idle wake every 50 ms).

A command whose caller gave up (its await was cancelled) before it ran is
skipped; one that ran anyway is undone: a generate's request is aborted, a
reservation's blocks are freed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine_errors import EngineDeadError, EngineError, InvalidRequestError, InvalidRequestReason, RequestFailedError
from pdcluster.services.engine.outputs import EngineStats, ExternalKVAllocation, RequestOutput
from pdcluster.services.engine.request import Request
from pdcluster.services.engine.reservation_line import ReservationLine
from pdcluster.services.sampling_params import SamplingParams, StreamDraw
from pdcluster.services.engine.turn_clock import TurnClock

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_POLL_S = 0.05  # how often an idle loop wakes to expire leases and reservations
FAULT_KINDS = ("kill", "stall")


class InjectedFault(RuntimeError):
    """What ``inject_fault("kill")`` raises inside the engine loop."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._line = ReservationLine()  # reservations waiting for free blocks (engine thread only)
        self._faults: deque[tuple[str, float]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._ended = False                   # the loop is gone (died or shut down): set before waiters hear
        self._dead: BaseException | None = None  # why it died
        self._last_turn_s = time.monotonic()
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        grammars = getattr(engine, "grammars", None)  # stand-in engines in tests have none
        if grammars is not None:
            grammars.forbidden_thread = self._thread   # a compile there raises: it would stall every stream
        self._thread.start()

    # ---- health ----------------------------------------------------------
    @property
    def alive(self) -> bool:
        """False once the loop died (or was shut down)."""
        return not self._ended

    def heartbeat_age_s(self) -> float:
        """Seconds since the loop last finished a turn (a step or an idle
        wake): about 0.05 when idle, one step's time when busy, growing
        without bound when stuck or dead."""
        return time.monotonic() - self._last_turn_s

    def check_alive(self) -> None:
        """Raises EngineDeadError, with the cause, once the loop is gone."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}; restart the replica")
        if self._ended:
            raise EngineDeadError("engine loop was shut down; restart the replica")

    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """A test hook for the serving layer's failure paths, acted on at the
        loop's next turn: "kill" makes the loop die as if a bug fired (every
        waiter gets EngineDeadError, ``alive`` turns False); "stall" makes it
        sleep ``seconds`` holding everything, like a stuck step."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        self._faults.append((kind, float(seconds)))
        self._wake.set()

    # ---- commands ------------------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        self.check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((fn, fut))
        self._wake.set()
        if self._ended:  # the loop ended after the check: nobody else will answer it
            self._fail_commands()
        return fut

    async def _call(self, fn: Callable[[], T], undo: Callable[[T], Any] | None = None) -> T:
        """Runs ``fn()`` on the engine thread between steps.  If the caller
        is cancelled and ``fn`` ran (or runs later) anyway, ``undo(result)``
        is queued after it."""
        fut = self._submit(fn)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if undo is not None:
                fut.add_done_callback(lambda f: self._undo(f, undo))
            raise

    def _undo(self, fut: concurrent.futures.Future, undo: Callable[[Any], Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # it never ran, or changed nothing
        result = fut.result()
        try:
            self._submit(lambda: undo(result))
        except EngineDeadError:
            pass  # the engine and everything it held are gone anyway

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps."""
        return await self._call(lambda: fn(self.engine))

    async def run_or_undo(self, fn: Callable[[Engine], T], undo: Callable[[Engine, T], Any]) -> T:
        """``run(fn)``; if the caller is cancelled and ``fn`` ran anyway, ``undo(engine, result)`` runs after it."""
        return await self._call(lambda: fn(self.engine), lambda result: undo(self.engine, result))

    # ---- requests ------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                       prefill_only: bool = False, prior_output_token_ids: Sequence[int] = (),
                       block_hashes: Sequence[int] = (), draw: StreamDraw | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; leaving before its last one aborts it.
        A request the engine failed raises RequestFailedError; a dead loop,
        EngineDeadError.  ``prior_output_token_ids``, ``block_hashes``, ``draw``: see Engine.add_request."""
        queue = self._open_stream(request_id)
        added = ended = False
        try:
            extra = await self._compile_grammar(params)
            # Only a resumed request passes its prior output (engines without resume need not know it).
            if prior_output_token_ids:
                extra["prior_output_token_ids"] = tuple(prior_output_token_ids)
            if block_hashes:
                extra["block_hashes"] = tuple(block_hashes)
            _add_draw(extra, params, draw)
            await self._call(lambda: self.engine.add_request(request_id, prompt, params, prefill_only, **extra),
                             undo=self._abort_added)
            added = True
            async for out in self._drain(request_id, queue):
                ended = out.finished  # a consumer that stops after the last output leaves nothing to abort
                yield out
        except RequestFailedError:
            ended = True
            raise
        finally:
            # Not ``aborted`` after the end: for a prefill-only request that
            # would release the lease its hand-off is about to be pulled under.
            await self._close_stream(request_id, abort=added and not ended)

    async def reserve_external(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                               ttl_s: float | None = None, block_hashes: Sequence[int] = (),
                               prior_output_token_ids: Sequence[int] = (), wait_s: float = 0.0,
                               draw: StreamDraw | None = None) -> ExternalKVAllocation | None:
        """Blocks for a prompt (and a resumed request's prior output) whose K/V
        comes from outside (see Engine.reserve_external); freed unless
        committed within ``ttl_s``.  When the pool cannot hold it now: None, or
        with ``wait_s`` it waits in line on the engine thread (reservation_line.py)
        for up to that long, and None only then."""
        extra = await self._compile_grammar(params)
        # Only a resumed request passes its prior output (engines without resume need not know it).
        if prior_output_token_ids:
            extra["prior_output_token_ids"] = tuple(prior_output_token_ids)
        _add_draw(extra, params, draw)

        def attempt() -> ExternalKVAllocation | None:
            return self.engine.reserve_external(request_id, prompt_token_ids, params, ttl_s, block_hashes, **extra)

        if wait_s <= 0:
            return await self._call(attempt, undo=self._abort_reservation)
        return await self._reserve_in_line(attempt, wait_s)

    async def _reserve_in_line(self, attempt: Callable[[], ExternalKVAllocation | None],
                               wait_s: float) -> ExternalKVAllocation | None:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        offered = self._submit(lambda: self._line.offer(attempt, answer, self._abort_reservation))
        offered.add_done_callback(lambda f: _pass_on_failure(f, answer))
        waiting = asyncio.wrap_future(answer)
        try:
            await asyncio.wait({waiting}, timeout=wait_s)
        except asyncio.CancelledError:
            if not answer.cancel() and answer.exception() is None:  # reserved as the caller left
                self._submit(lambda: self._abort_reservation(answer.result()))
            raise
        if answer.cancel():  # still in line at the deadline: it leaves the line
            return None
        return answer.result()  # reserved (or failed) in time

    async def decode_external(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        """After the reserved blocks were filled: streams the decode."""
        queue = self._open_stream(request_id)
        committed = ended = False
        try:
            req = await self._call(lambda: self.engine.commit_external(request_id, first_token_id),
                                   undo=self._abort_added)
            committed, ended = True, req.is_finished
            if ended:
                return
            async for out in self._drain(request_id, queue):
                ended = out.finished
                yield out
        except RequestFailedError:
            ended = True
            raise
        finally:
            await self._close_stream(request_id, abort=committed and not ended)

    async def _compile_grammar(self, params: SamplingParams) -> dict[str, Any]:
        """A structured request's grammar, compiled in the replica's compile
        pool (grammar.py; awaited, no thread held), as the ``grammar`` keyword
        for the engine: the engine thread never compiles.  InvalidRequestError when
        the spec does not compile or runs past the compile limit."""
        spec = getattr(params, "guided", None)  # stand-in engines and params in tests have none
        if spec is None:
            return {}
        # Shielded: a caller that leaves must not cancel a compile other requests share.
        grammar = await asyncio.shield(asyncio.wrap_future(self.engine.grammars.compile_future(spec)))
        return {"grammar": grammar}

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self.engine.abort(request_id))

    async def quarantine(self, request_id: str, block_ids: Sequence[int]) -> int | None:
        """Engine.quarantine: the reservation ends, ``block_ids`` stay held until release_quarantine."""
        return await self._call(lambda: self.engine.quarantine(request_id, block_ids))

    async def release_quarantine(self, key: int) -> int:
        return await self._call(lambda: self.engine.release_quarantine(key))

    async def release_lease(self, request_id: str) -> bool:
        return await self._call(lambda: self.engine.release_lease(request_id))

    def _abort_added(self, req: Request) -> bool:
        """Undoes an add or commit whose caller gave up: aborts the request (or
        drops the lease it already left), unless its id now names another one."""
        e, rid = self.engine, req.request_id
        if e.requests.get(rid, req) is not req or rid in e.awaiting_kv:
            return False
        return e.abort(rid)

    def _abort_reservation(self, alloc: ExternalKVAllocation | None) -> bool:
        """Undoes a reservation whose caller gave up: its blocks go back."""
        req = self.engine.awaiting_kv.get(alloc.request_id) if alloc is not None else None
        return req is not None and tuple(req.block_ids) == alloc.block_ids and self.engine.abort(alloc.request_id)

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        self.check_alive()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already streaming; pick a unique id")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        while True:
            item = await queue.get()
            # Outputs that piled up while this consumer was busy leave as one:
            # when the event loop falls behind the engine, fewer, larger
            # messages go through Serve instead of a growing backlog.
            while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    queue.put_nowait(later)  # terminal; raised on the next turn
                    break
                item = item.followed_by(later)
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def _close_stream(self, request_id: str, abort: bool) -> None:
        if self._streams.pop(request_id, None) is None or not abort or self._ended:
            return
        # Not finished (consumer left, or error): abort; a no-op if it ended meanwhile.
        try:
            await asyncio.shield(self._call(lambda: self.engine.abort(request_id)))
        except EngineDeadError:
            pass  # died meanwhile: nothing is left to abort

    # ---- the engine thread ------------------------------------------------
    def _loop(self) -> None:
        try:
            turns = 0
            while not self._stop:
                turns += 1
                turn = TurnClock()
                self._apply_fault()
                self._apply_commands()
                turn.mark("commands")
                self._line.serve()  # reservations waiting for blocks: a step or a command may have freed some
                turn.mark("reservations")
                if self.engine.has_unfinished():
                    outputs = self.engine.step()  # fails requests, not itself; EngineDeadError if it cannot go on
                    turn.mark("step")
                    self.stats = self.engine.stats()
                    turn.mark("stats")
                    self._deliver_step(outputs)
                    turn.mark("deliver")
                    turn.log_if_slow(log, turns)
                else:
                    self.engine.expire_stale()
                    self.stats = self.engine.stats()
                    self._wake.wait(_IDLE_POLL_S)
                    self._wake.clear()
                self._last_turn_s = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            log.exception("engine loop died")
            self._dead = exc
            self._end(EngineDeadError(f"engine loop died: {exc!r}; restart the replica"))
            return
        self._end(EngineDeadError("engine loop was shut down; restart the replica"))

    def _apply_fault(self) -> None:
        if not self._faults:
            return
        kind, seconds = self._faults.popleft()
        log.warning("injected engine fault: kind=%s seconds=%s", kind, seconds)
        if kind == "kill":
            raise InjectedFault("killed by inject_fault('kill'), a test hook")
        time.sleep(seconds)

    def _apply_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up before it ran
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            except BaseException as exc:
                fut.set_exception(exc)
                raise
            else:
                fut.set_result(result)

    def _end(self, error: EngineDeadError) -> None:
        """The loop is gone: every stream and every queued command hears why."""
        self._ended = True
        self._deliver_all([(rid, error) for rid in list(self._streams)])
        self._fail_commands(error)
        self._line.fail_all(error)

    def _fail_commands(self, error: EngineDeadError | None = None) -> None:
        error = error or EngineDeadError("engine loop is gone; restart the replica")
        while True:
            try:
                _, fut = self._commands.popleft()
            except IndexError:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        self._deliver_all([(out.request_id, out if out.error is None else _failure(out.error)) for out in outputs])
        for out in outputs:
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        """Hands each (request id, item) to its stream, in one callback per
        event loop (one wake-up per step rather than one per sequence)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream[0], []).append((stream[1], item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed
                pass

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
        grammars = getattr(self.engine, "grammars", None)
        if grammars is not None:
            grammars.close()   # its compile worker processes


def _pass_on_failure(command: concurrent.futures.Future, answer: concurrent.futures.Future) -> None:
    """A command that failed (the loop ended before it ran) fails the answer it was to give."""
    if command.cancelled() or command.exception() is None:
        return
    try:
        answer.set_exception(command.exception())
    except concurrent.futures.InvalidStateError:
        pass  # answered or given up already


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def _failure(why: str) -> EngineError:
    """The typed error a failed request's stream raises: the request's own
    fault (InvalidRequestReason) is a 400, anything else a retryable failure."""
    return InvalidRequestError(why) if isinstance(why, InvalidRequestReason) else RequestFailedError(why)


def _add_draw(extra: dict[str, Any], params: SamplingParams, draw: StreamDraw | None) -> None:
    """Only a stream whose draw differs from its params' passes it (engines without choices
    or failover need not know it)."""
    if draw is not None and draw != StreamDraw.of(params):
        extra["draw"] = draw
