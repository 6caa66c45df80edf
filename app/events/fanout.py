"""Live run events for every stream of one API process from one LISTEN.

Each run event but a run's ``created`` notifies ``trainyard_run_events`` (migration 0016)
with its run and id, after commit. The process listens on one connection of its
own; for a run that has subscribers it reads the new events once, renders each Server-Sent
Event once (framed as app/events/sse.py says), and hands the same bytes to every subscriber.
An idle stream costs nothing: no query runs until something happens to its run.

Exactly once and in order, per subscriber:

- A subscriber registers first, then reads the log from its own position ("catch-up") until
  it is level, then takes what the hub hands it, skipping ids it has already sent. Per run,
  ids commit in order (app/events/service.py), and notifications arrive in commit order, so
  the first notification the hub handles after a registration names an id no later than any
  event the catch-up could not see: the hub starts there (``cursor``) and misses nothing.
- The listening connection can drop (PostgreSQL restarts). Notifications sent meanwhile are
  lost, so on reconnecting the hub reads every subscribed run again from the earliest
  position any of its subscribers holds; subscribers skip what they already sent.
- A subscriber that cannot keep up (its client reads slowly) is never waited for: once its
  buffer holds more than ``buffer`` events it is closed with a retry hint, and its client
  resumes from its last id (``Last-Event-ID``), reading the log.

What a live event costs is one write per subscriber: the hub gathers what commits within
``gather_seconds`` into one read and one chunk, and one timer of its own sends the idle
streams their keep-alives (a timer per stream's wait was a tenth of the API's time under a
thousand streams: bench/watchers.py).

A stream ends after its run's last event: the events and the run's status are read in one
statement (one snapshot), so a terminal status comes with the event that recorded it.

The hub listens only while something needs it: a stream, or a conditional GET (the run
ETags it answers from memory) within the last ``idle_seconds``. PostgreSQL wakes every
listening backend of a database for every NOTIFY on any channel, so each idle LISTEN cost
every run's creation (its ``trainyard_runs_due``) some 30 µs of PostgreSQL CPU per API
process (docs/benchmarks.md, "The request path against 224089f"). Starting to listen is a
reconnect as above: what it had not heard is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg

from app.core.pg import connect_kwargs
from app.events.service import STREAM_BATCH, StreamBatch, stream_read
from app.events.sse import KEEP_ALIVE, TOO_FAR_BEHIND, end

log = logging.getLogger(__name__)

#: What migration 0016's trigger notifies per event: ``<run id>:<event id>:<event id>`` (the
#: first and last new ids of 0010's statement-level trigger, kept as one shape).
CHANNEL = "trainyard_run_events"


@dataclass(eq=False, slots=True)
class Subscriber:
    """One stream's place in the hub: what it has sent and what waits to be sent."""

    position: int  # the last event id sent (or the position it started after)
    buffer: int
    pending: deque[StreamBatch] = field(default_factory=deque)
    queued: int = 0  # events in pending
    ended: bytes | None = None  # the `end` message, once the hub saw the run's last event
    dropped: bool = False  # fell more than `buffer` events behind
    quiet: bool = False  # sent nothing for a keep-alive period: send one
    sent_at: float = field(default_factory=time.monotonic)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, batch: StreamBatch) -> None:
        if self.dropped:
            return
        self.pending.append(batch)
        self.queued += len(batch.events)
        if self.queued > self.buffer:
            self.dropped = True
            self.pending.clear()
        elif batch.last:
            self.ended = end(batch.status)
        self.wake.set()

    def take(self) -> bytes:
        """What is pending and not sent yet, as one write: each batch's shared chunk, or
        (a batch that overlaps what the catch-up sent) the messages after the position."""
        out = []
        while self.pending:
            batch = self.pending.popleft()
            if not batch.events or batch.events[-1][0] <= self.position:
                continue
            if batch.events[0][0] > self.position:
                out.append(batch.chunk)
            else:
                fresh = "".join(m for i, m in batch.events if i > self.position)
                out.append(fresh.encode())
            self.position = batch.events[-1][0]
        self.queued = 0
        return b"".join(out)


@dataclass(slots=True)
class _Known:
    """What the hub knows of a run while it listens: its last event id, and its project once
    a read through the database told it (its ETags need no query: conditional.py)."""

    latest: int
    project_id: uuid.UUID | None = None


#: How long the hub goes on listening once no stream and no conditional GET needs it.
LISTEN_IDLE_SECONDS = 300.0

# Runs whose last event id the hub keeps, the least recently notified or read forgotten first.
KNOWN_RUNS = 100_000


@dataclass(eq=False, slots=True)
class _Run:
    subscribers: set[Subscriber] = field(default_factory=set)
    cursor: int | None = None  # the hub has handed out every event up to here
    reading: asyncio.Task[None] | None = None
    again: bool = False  # notified while reading: read once more


class EventHub:
    """The process's one LISTEN, and the subscribers of each run it serves."""

    def __init__(
        self,
        url: str,
        pool: asyncpg.Pool,
        *,
        buffer: int,
        keepalive_seconds: float,
        gather_seconds: float = 0.0,
        idle_seconds: float = LISTEN_IDLE_SECONDS,
    ) -> None:
        self._url = url
        self._pool = pool
        self._buffer = buffer
        self._keepalive = keepalive_seconds
        self._gather = gather_seconds
        self._runs: dict[uuid.UUID, _Run] = {}
        self._known: OrderedDict[uuid.UUID, _Known] = OrderedDict()
        self._epoch = 0  # bumped on every (re)connect: what was known before may be stale
        self._backend_pid: int | None = None
        self._listening = asyncio.Event()
        self._idle_seconds = idle_seconds
        self._wanted_at = -idle_seconds  # never: nothing has needed it yet
        self._listener: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the keep-alive timer; the hub listens once something needs it."""
        self._tasks = [asyncio.create_task(self._keep_alive_forever(), name="event-hub-keep-alive")]

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._listener] if self._listener is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for state in self._runs.values():
            if state.reading is not None:
                state.reading.cancel()

    def want(self) -> None:
        """Something needs live notifications (a stream, a conditional GET): listen if the
        hub does not, and go on for ``idle_seconds`` more."""
        self._wanted_at = time.monotonic()
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen_while_wanted(), name="event-hub")

    def _idle_for(self) -> float:
        """How much longer the hub listens with nothing needing it (<= 0: stop now)."""
        if self._runs:
            return self._idle_seconds
        return self._wanted_at + self._idle_seconds - time.monotonic()

    async def listening(self) -> None:
        """Returns once the hub listens, starting to if it did not (at once, unless its
        connection is being made or remade)."""
        self.want()
        await self._listening.wait()

    async def not_listening(self) -> None:
        """Returns once the hub does not listen (at once if it does not; else when nothing
        has needed it for ``idle_seconds``)."""
        if self._listener is not None:
            await asyncio.shield(self._listener)

    @property
    def backend_pid(self) -> int | None:
        """The PostgreSQL backend of the LISTEN connection, while there is one (several
        processes' hubs can listen on one database, all named ``trainyard-hub``)."""
        return self._backend_pid

    async def _listen_while_wanted(self) -> None:
        delay = 0.2
        while self._idle_for() > 0:
            try:
                await self._listen_once()
                delay = 0.2  # it listened, then lost the connection or was idle
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning("event hub cannot listen (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _listen_once(self) -> None:
        """LISTEN until the connection is lost."""
        lost = asyncio.Event()
        conn = await asyncpg.connect(
            **connect_kwargs(self._url), server_settings={"application_name": "trainyard-hub"}
        )
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(CHANNEL, self._notified)
            self._backend_pid = conn.get_server_pid()
            self._known.clear()
            self._epoch += 1
            self._listening.set()
            self._resync()  # whatever was notified while nobody listened
            while (idle := self._idle_for()) > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle):
                        await lost.wait()
                if lost.is_set():
                    log.warning("event hub lost its connection; reconnecting")
                    return
            log.info("event hub stops listening: nothing needed it for %.0fs", self._idle_seconds)
        finally:
            self._listening.clear()
            self._backend_pid = None
            self._known.clear()
            with contextlib.suppress(Exception):
                await conn.close(timeout=1)

    async def _keep_alive_forever(self) -> None:
        """Each stream that sent nothing for ``keepalive`` seconds is told to send a
        keep-alive: within a quarter period more, one timer for all of them."""
        period = self._keepalive / 4
        while True:
            await asyncio.sleep(period)
            due = time.monotonic() - self._keepalive
            for state in self._runs.values():
                for subscriber in state.subscribers:
                    if subscriber.sent_at <= due:
                        subscriber.quiet = True
                        subscriber.wake.set()

    # -- subscribing -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def subscribe(self, run_id: uuid.UUID, after_id: int) -> AsyncIterator[Subscription]:
        subscriber = Subscriber(position=after_id, buffer=self._buffer)
        state = self._runs.setdefault(run_id, _Run())
        state.subscribers.add(subscriber)
        self.want()
        try:
            yield Subscription(self, run_id, subscriber)
        finally:
            self._wanted_at = time.monotonic()  # idle from the last stream's end
            state.subscribers.discard(subscriber)
            if not state.subscribers and self._runs.get(run_id) is state:
                del self._runs[run_id]
                if state.reading is not None:
                    state.reading.cancel()

    # -- fan-out -----------------------------------------------------------------------

    # -- the last event id of each run, for ETags -----------------------------------------

    def epoch(self) -> int | None:
        """Changes whenever notifications may have been missed; None while not listening."""
        return self._epoch if self._listening.is_set() else None

    def latest(self, run_id: uuid.UUID, project_id: uuid.UUID) -> int | None:
        """The run's last event id if the hub knows it for this project, else None. Asked
        by a conditional GET: the hub listens (from now, if it did not) to know next time."""
        self.want()
        known = self._known.get(run_id)
        if known is None or known.project_id != project_id or not self._listening.is_set():
            return None
        return known.latest

    def read_through(
        self, run_id: uuid.UUID, project_id: uuid.UUID, latest: int, epoch: int | None
    ) -> None:
        """Remember what a read of the database (which began at ``epoch``) saw: the run is
        the project's, its last event id was ``latest`` or is one notified since."""
        if epoch is None or epoch != self.epoch():
            return  # notifications may have been missed since the read began
        known = self._known.get(run_id)
        if known is None:
            self._remember(run_id, _Known(latest, project_id))
        else:
            known.latest = max(known.latest, latest)
            known.project_id = project_id

    def _remember(self, run_id: uuid.UUID, known: _Known) -> None:
        self._known[run_id] = known
        self._known.move_to_end(run_id)
        if len(self._known) > KNOWN_RUNS:
            self._known.popitem(last=False)

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            run, first, last = payload.split(":")
            run_id, first_id, last_id = uuid.UUID(run), int(first), int(last)
        except ValueError:
            log.warning("event hub ignores a malformed notification %r", payload)
            return
        known = self._known.get(run_id)
        if known is None:
            self._remember(run_id, _Known(last_id))
        else:
            known.latest = max(known.latest, last_id)
            self._known.move_to_end(run_id)
        state = self._runs.get(run_id)
        if state is None:
            return
        if state.cursor is None:
            state.cursor = first_id - 1
        self._read_soon(run_id, state)

    def _resync(self) -> None:
        for run_id, state in self._runs.items():
            if state.subscribers:
                earliest = min(s.position for s in state.subscribers)
                state.cursor = earliest if state.cursor is None else min(state.cursor, earliest)
                self._read_soon(run_id, state)

    def _read_soon(self, run_id: uuid.UUID, state: _Run) -> None:
        if state.reading is not None and not state.reading.done():
            state.again = True
            return
        state.reading = asyncio.create_task(self._read(run_id, state))

    async def _read(self, run_id: uuid.UUID, state: _Run) -> None:
        gather = True
        while True:
            if gather and self._gather:
                # A step commits a few transactions in quick succession: one read (and one
                # write to each subscriber) for all of them, instead of one each. Commits
                # notified during a read are gathered again, not read at once.
                await asyncio.sleep(self._gather)
            state.again = False
            assert state.cursor is not None
            try:
                batch = await stream_read(self._pool, run_id, state.cursor)
            except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
                # The cursor stays: the next try (or the listener's resync) reads from it.
                log.warning("event hub cannot read run %s (%s); retrying", run_id, exc)
                await asyncio.sleep(1.0)
                state.again = True
                continue
            if batch.events:
                state.cursor = batch.events[-1][0]
            for subscriber in state.subscribers:
                subscriber.offer(batch)
            gather = len(batch.events) < STREAM_BATCH  # a full batch: read the rest at once
            if gather and not state.again:
                return


class Subscription:
    """One stream: its catch-up from the log, then what the hub hands it."""

    def __init__(self, hub: EventHub, run_id: uuid.UUID, subscriber: Subscriber) -> None:
        self._hub = hub
        self._run_id = run_id
        self._me = subscriber

    async def messages(self) -> AsyncIterator[bytes]:
        """Each event once, in order, then `end`; keep-alives while idle. Returns early
        (after a retry hint) when it fell too far behind."""
        me = self._me
        while True:  # catch-up: read the log until level with it
            batch = await stream_read(self._hub._pool, self._run_id, me.position)
            if batch.events:
                me.position = batch.events[-1][0]
                yield batch.chunk
            if batch.last:
                yield end(batch.status)
                return
            if len(batch.events) < STREAM_BATCH:
                break
        while True:
            if not me.pending and me.ended is None and not me.dropped and not me.quiet:
                me.wake.clear()
                await me.wake.wait()  # the hub's offer, or its keep-alive timer
            fresh = me.take()  # one write for everything that came at once
            quiet, me.quiet = me.quiet, False
            if fresh or quiet:
                me.sent_at = time.monotonic()
                yield fresh or KEEP_ALIVE
            if me.dropped:
                # Resume from the last id sent: the client reconnects with Last-Event-ID.
                yield TOO_FAR_BEHIND
                return
            if me.ended is not None:
                yield me.ended
                return
