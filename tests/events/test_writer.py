"""The event log's one writer (app/events/service.py): nothing else in app/ or workers/ inserts
events, every statement that does holds the run's row lock, and so ids of one run become
visible in order however many writers race (what readers resuming from the last id they saw
rely on: docs/architecture.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from app.core.domain import NotFound
from app.events import service as events
from app.runs import repository
from app.runs.lifecycle import state
from app.runs.lifecycle.leases import claim
from app.runs.lifecycle.state import Move, apply, transition
from app.runs.lifecycle.status import RunStatus
from app.training_data import jsonl
from tests.support import ROOT
from tests.support.runs import create_run

WRITER = ROOT / "app" / "events" / "service.py"

# Ways of inserting events: SQL, SQLAlchemy's insert, an ORM object added to a session, COPY.
INSERTS = {
    "INSERT INTO run_events": re.compile(r"insert\s+into\s+run_events\b", re.IGNORECASE),
    "insert(RunEvent)": re.compile(r"\binsert\(\s*RunEvent\b"),
    "RunEvent(...)": re.compile(r"(?<!class )\bRunEvent\s*\("),
    "COPY into run_events": re.compile(
        r"copy\w*\(\s*['\"]run_events['\"]|\bcopy\s+run_events\b", re.IGNORECASE
    ),
}


def test_only_the_writer_inserts_events() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{source.count(chr(10), 0, m.start()) + 1}: {name}"
        for top in ("app", "workers")
        for path in sorted((ROOT / top).rglob("*"))
        if path.suffix in {".py", ".sql"} and path != WRITER
        for source in [path.read_text(encoding="utf-8")]
        for name, pattern in INSERTS.items()
        for m in pattern.finditer(source)
    ]
    assert not found, (
        "run_events rows are inserted only through app/events/service.py (append, or "
        "insert_events in a statement that holds the run's row lock):\n" + "\n".join(found)
    )
    writer = WRITER.read_text(encoding="utf-8")
    assert len(INSERTS["INSERT INTO run_events"].findall(writer)) == 1  # insert_events


@pytest.mark.parametrize(
    "statement",
    [
        events._APPEND.text,
        state._STATEMENT,
        repository._CREATE,
        repository._CREATE_FROM_DATASET,
        jsonl._IMPORT_RUN,
    ],
    ids=["append", "move", "create", "create_from_dataset", "jsonl_import"],
)
def test_every_statement_that_appends_holds_the_row_lock(statement: str) -> None:
    """Before its events, the statement locks the run's row or inserts the run (a row no
    other transaction sees before this one commits)."""
    before, insert, _ = statement.partition(events.insert_events(""))
    assert insert, "the statement appends through insert_events"
    locks = re.search(r"FROM runs WHERE id = \S+ FOR (NO KEY )?UPDATE", before)
    creates = re.search(r"INSERT INTO runs \(id,", before)
    assert locks or creates


async def _pid(session: AsyncSession) -> int:
    return int(await session.scalar(text("SELECT pg_backend_pid()")))


async def _blocked_by(session: AsyncSession, waiting: int, holding: int) -> None:
    """Return once ``waiting``'s backend waits for a lock ``holding`` holds."""
    async with asyncio.timeout(10):
        while True:
            blockers = await session.scalar(text("SELECT pg_blocking_pids(:pid)"), {"pid": waiting})
            if holding in (blockers or []):
                return
            await asyncio.sleep(0.02)


async def _ids(sessionmaker: Any, run_id: uuid.UUID) -> list[int]:
    async with sessionmaker() as s:
        rows = await s.execute(
            text("SELECT id FROM run_events WHERE run_id = :id ORDER BY id"), {"id": run_id}
        )
        return list(rows.scalars())


Writer = Callable[[AsyncSession, uuid.UUID], Coroutine[Any, Any, Any]]


async def _move(s: AsyncSession, run_id: uuid.UUID) -> Any:
    return await transition(s, run_id, RunStatus.GENERATING, expected=RunStatus.PENDING)


async def _append(s: AsyncSession, run_id: uuid.UUID) -> Any:
    return await events.append(s, run_id, "log", "appended")


async def _claim(s: AsyncSession, run_id: uuid.UUID) -> Any:
    return await claim(s, run_id, owner="w", ttl_seconds=60, max_attempts=3)


WRITERS: dict[str, Writer] = {"move": _move, "append": _append, "claim": _claim}
PAIRS = [(a, b) for a in WRITERS for b in WRITERS if a != b]


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a}-then-{b}" for a, b in PAIRS])
async def test_a_second_writer_waits_for_the_first_to_commit(
    sessionmaker: Any, tenant: Any, first: str, second: str
) -> None:
    """Two writers of one run on two connections: the second waits on the first's row lock,
    so its ids are drawn after the first's commit, and a reader never sees a later id
    before an earlier one."""
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    before = await _ids(sessionmaker, run.id)
    async with sessionmaker() as a, sessionmaker() as b, sessionmaker() as observer:
        holder = await _pid(a)
        waiter = await _pid(b)
        await WRITERS[first](a, run.id)
        late = asyncio.create_task(WRITERS[second](b, run.id))
        await _blocked_by(observer, waiter, holder)
        assert await _ids(sessionmaker, run.id) == before  # nothing of a's is visible yet
        await a.commit()
        await late
        after_first = await _ids(sessionmaker, run.id)
        await b.commit()
    after_both = await _ids(sessionmaker, run.id)
    assert after_first[: len(before)] == before and len(after_first) > len(before)
    assert after_both[: len(after_first)] == after_first and len(after_both) > len(after_first)


async def test_racing_writers_ids_become_visible_in_order(sessionmaker: Any, tenant: Any) -> None:
    """Writers of every kind append to one run at once while a reader polls its log: every
    read extends the one before (a reader resuming after the last id it saw misses nothing)."""
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    rounds = 15
    done = asyncio.Event()

    async def appender() -> None:
        for i in range(rounds):
            async with sessionmaker() as s:
                await events.append(s, run.id, "log", f"append {i}")
                await events.append(s, run.id, "log", f"append {i}, again")
                await s.commit()

    async def mover() -> None:
        for i in range(rounds):
            async with sessionmaker() as s:
                # The run keeps its status; the move's statement appends the event.
                event = {"type": "log", "message": f"move {i}", "data": {}}
                await apply(s, Move(run.id, RunStatus.PENDING, stay=True, events=(event,)))
                await s.commit()

    async def reader() -> list[list[int]]:
        reads = []
        while not done.is_set():
            reads.append(await _ids(sessionmaker, run.id))
            await asyncio.sleep(0)
        return reads

    watching = asyncio.create_task(reader())
    await asyncio.gather(appender(), appender(), mover(), mover())
    done.set()
    reads = await watching
    final = await _ids(sessionmaker, run.id)
    assert len(final) == 1 + rounds * (2 * 2 + 2)  # created, then every writer's
    for earlier, later in itertools.pairwise([*reads, final]):
        assert later[: len(earlier)] == earlier, "an id became visible before an earlier one"


async def test_append_to_a_run_that_is_gone_raises_not_found(sessionmaker: Any) -> None:
    async with sessionmaker() as s:
        with pytest.raises(NotFound):
            await events.append(s, uuid.uuid4(), "log", "nobody")


async def test_an_import_inserts_its_run_and_event_in_one_statement(
    sessionmaker: Any, tenant: Any, service_urls: tuple[str, str]
) -> None:
    line = {"messages": [{"role": "user", "content": "hi"}], "rollout_index": 1, "step": 2}
    result = await jsonl.import_jsonl_async(
        service_urls[0], [json.dumps(line)], project=tenant.project_id
    )
    (run_id,) = result.run_ids.values()
    async with sessionmaker() as s:
        rows = await s.execute(
            text("SELECT type, message, data FROM run_events WHERE run_id = :id"), {"id": run_id}
        )
        assert [tuple(r) for r in rows] == [
            ("imported", "imported 1 trajectories", {"source_run_id": None, "trajectories": 1})
        ]
