"""The public functions: query Trainyard's trajectories and runs straight from PostgreSQL.

Every function takes the database first: a URL (``postgresql://…`` or SQLAlchemy's
``postgresql+asyncpg://…``), ``None`` for this installation's configured (or embedded)
database, or, for the async functions, an open :func:`connect` connection or pool for many
queries in a row. Sync functions work in plain scripts and inside a running event loop
(Jupyter, an async web handler): there they run on a private loop in a helper thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, suppress
from datetime import date, datetime
from typing import TypeAlias, TypedDict, TypeVar, Unpack

import asyncpg

from app.core.pg import connect_kwargs, init_connection
from app.training_data import queries
from app.training_data.filters import Filters, TrainingDataError, check_limit, check_order
from app.training_data.records import TrainingRun, TrainingTrajectory

T = TypeVar("T")
Database: TypeAlias = str | asyncpg.Connection | asyncpg.Pool | None


class TrajectoryFilters(TypedDict, total=False):
    """The filters every trajectory function accepts; each narrows the result, all combine.

    - ``min_reward`` / ``max_reward``: inclusive bounds (unscored rollouts are left out).
    - ``projects``: project names or ids.
    - ``run_ids``: runs' ids.
    - ``learning_key``: one key or several (the runs' grouping key).
    - ``statuses``: the run's current status (``"completed"``, ``"failed"``, …).
    - ``start_date`` / ``end_date``: when the trajectory was written, both inclusive; a naive
      datetime is UTC (as in the REST API); an end ``date`` includes that whole day.
    - ``steps``: step numbers (a list, or a ``range``).
    - ``min_tool_calls``: agent episodes that made at least this many tool calls (the
      ``tool_calls`` of their metadata; rows without it made none).
    """

    min_reward: float | None
    max_reward: float | None
    projects: str | Iterable[str | uuid.UUID] | None
    run_ids: str | uuid.UUID | Iterable[str | uuid.UUID] | None
    learning_key: str | Iterable[str] | None
    statuses: str | Iterable[str] | None
    start_date: datetime | date | None
    end_date: datetime | date | None
    steps: int | Iterable[int] | None
    min_tool_calls: int | None


class RunFilters(TypedDict, total=False):
    """The filters of the run functions: as :class:`TrajectoryFilters`, less reward and step
    (dates are the run's creation)."""

    projects: str | Iterable[str | uuid.UUID] | None
    run_ids: str | uuid.UUID | Iterable[str | uuid.UUID] | None
    learning_key: str | Iterable[str] | None
    statuses: str | Iterable[str] | None
    start_date: datetime | date | None
    end_date: datetime | date | None


def _database_url(db: str | None) -> str:
    if db is not None:
        return db
    from app.core.services import client_database_url
    from app.core.settings import get_settings

    # The configured database or the running installation's; never a new embedded one.
    return client_database_url(get_settings())


async def open_connection(db_url: str | None = None) -> asyncpg.Connection:
    """A connection set up the way the library reads rows (JSONB as Python objects)."""
    conn = await asyncpg.connect(
        **connect_kwargs(_database_url(db_url)),
        server_settings={"application_name": "trainyard-training-data"},
    )
    await init_connection(conn)
    return conn


@asynccontextmanager
async def connect(db: Database = None) -> AsyncIterator[asyncpg.Connection]:
    """A connection for ``db``: borrowed (from a pool, or the connection itself) or opened
    for the duration and closed after."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    elif isinstance(db, asyncpg.Connection):
        yield db
    else:
        conn = await open_connection(db)
        try:
            yield conn
        finally:
            await conn.close()


def run_sync(make: Callable[[], Awaitable[T]]) -> T:
    """Run ``make()`` to completion from sync code, whether or not a loop is running here."""

    async def main() -> T:
        return await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    result: list[T] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            result.append(asyncio.run(main()))
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=worker, name="trainyard-training-data")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def sync_database(db: Database) -> str | None:
    if db is not None and not isinstance(db, str):
        raise TrainingDataError(
            "db_url", "sync functions take a URL; pass connections to the *_async functions"
        )
    return db


# --- trajectories -----------------------------------------------------------------------


async def get_training_trajectories_async(
    db_url: Database = None,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
    include_group_stats: bool = False,
    limit: int | None = None,
    order: str = "newest",
    **filters: Unpack[TrajectoryFilters],
) -> list[TrainingTrajectory]:
    """The trajectories matching ``filters``, newest first (``order="oldest"`` for the
    reverse), at most ``limit``. For more rows than fit in memory use
    :func:`paginate_trajectories`."""
    f = Filters.build(**filters)
    checked_limit = check_limit("limit", limit)
    checked_order = check_order(order)
    async with connect(db_url) as conn:
        return await queries.fetch_trajectories(
            conn,
            f,
            include_messages=include_messages,
            include_metadata=include_metadata,
            include_group_stats=include_group_stats,
            order=checked_order,
            limit=checked_limit,
        )


def get_training_trajectories(
    db_url: str | None = None,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
    include_group_stats: bool = False,
    limit: int | None = None,
    order: str = "newest",
    **filters: Unpack[TrajectoryFilters],
) -> list[TrainingTrajectory]:
    """Sync :func:`get_training_trajectories_async`."""
    db = sync_database(db_url)
    return run_sync(
        lambda: get_training_trajectories_async(
            db,
            include_messages=include_messages,
            include_metadata=include_metadata,
            include_group_stats=include_group_stats,
            limit=limit,
            order=order,
            **filters,
        )
    )


async def count_training_trajectories_async(
    db_url: Database = None, **filters: Unpack[TrajectoryFilters]
) -> int:
    """How many trajectories match ``filters``; no row is loaded."""
    f = Filters.build(**filters)
    async with connect(db_url) as conn:
        return await queries.count_trajectories(conn, f)


def count_training_trajectories(
    db_url: str | None = None, **filters: Unpack[TrajectoryFilters]
) -> int:
    """Sync :func:`count_training_trajectories_async`."""
    db = sync_database(db_url)
    return run_sync(lambda: count_training_trajectories_async(db, **filters))


async def get_trajectory_by_id_async(
    db_url: Database,
    trajectory_id: str | uuid.UUID,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
) -> TrainingTrajectory | None:
    """One trajectory, or ``None`` if there is none with that id."""
    try:
        tid = trajectory_id if isinstance(trajectory_id, uuid.UUID) else uuid.UUID(trajectory_id)
    except (TypeError, ValueError, AttributeError) as exc:
        raise TrainingDataError("trajectory_id", f"{trajectory_id!r} is not a UUID") from exc
    async with connect(db_url) as conn:
        return await queries.fetch_trajectory(
            conn, tid, include_messages=include_messages, include_metadata=include_metadata
        )


def get_trajectory_by_id(
    db_url: str | None,
    trajectory_id: str | uuid.UUID,
    *,
    include_messages: bool = True,
    include_metadata: bool = True,
) -> TrainingTrajectory | None:
    """Sync :func:`get_trajectory_by_id_async`."""
    db = sync_database(db_url)
    return run_sync(
        lambda: get_trajectory_by_id_async(
            db, trajectory_id, include_messages=include_messages, include_metadata=include_metadata
        )
    )


async def paginate_trajectories(
    db_url: Database = None,
    *,
    batch_size: int = 100,
    include_messages: bool = True,
    include_metadata: bool = True,
    include_group_stats: bool = False,
    limit: int | None = None,
    order: str = "newest",
    **filters: Unpack[TrajectoryFilters],
) -> AsyncIterator[list[TrainingTrajectory]]:
    """Every matching trajectory, ``batch_size`` at a time, by keyset: the 10,000th batch
    costs what the first does, and nothing is held open between batches."""
    f = Filters.build(**filters)
    size = check_limit("batch_size", batch_size, allow_none=False)
    assert size is not None
    checked_limit = check_limit("limit", limit)
    checked_order = check_order(order)
    async with connect(db_url) as conn:
        async for batch in queries.trajectory_pages(
            conn,
            f,
            batch_size=size,
            include_messages=include_messages,
            include_metadata=include_metadata,
            include_group_stats=include_group_stats,
            order=checked_order,
            limit=checked_limit,
        ):
            yield batch


def iter_trajectories(
    db_url: str | None = None,
    *,
    batch_size: int = 500,
    include_messages: bool = True,
    include_metadata: bool = True,
    include_group_stats: bool = False,
    limit: int | None = None,
    order: str = "newest",
    **filters: Unpack[TrajectoryFilters],
) -> Iterator[TrainingTrajectory]:
    """Sync, one trajectory at a time (fetched ``batch_size`` at a time by a helper thread,
    one batch ahead): what :func:`to_hf_dataset` and plain scripts stream from."""
    db = sync_database(db_url)
    Filters.build(**filters)  # bad arguments fail here, in the caller's thread
    batches: queue.Queue[list[TrainingTrajectory] | BaseException | None] = queue.Queue(1)
    stop = threading.Event()

    async def produce() -> None:
        async for batch in paginate_trajectories(
            db,
            batch_size=batch_size,
            include_messages=include_messages,
            include_metadata=include_metadata,
            include_group_stats=include_group_stats,
            limit=limit,
            order=order,
            **filters,
        ):
            if stop.is_set():
                return
            await asyncio.to_thread(batches.put, batch)

    def worker() -> None:
        try:
            asyncio.run(produce())
            batches.put(None)
        except BaseException as exc:  # re-raised in the consumer
            batches.put(exc)

    thread = threading.Thread(target=worker, name="trainyard-training-data", daemon=True)
    thread.start()
    try:
        while (item := batches.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield from item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            with suppress(queue.Empty):
                batches.get(timeout=0.05)


# --- runs -------------------------------------------------------------------------------


async def get_training_runs_async(
    db_url: Database = None,
    *,
    limit: int | None = None,
    order: str = "newest",
    **filters: Unpack[RunFilters],
) -> list[TrainingRun]:
    """The runs matching ``filters``, newest first, at most ``limit``."""
    f = Filters.build(**filters)
    checked_limit = check_limit("limit", limit)
    checked_order = check_order(order)
    async with connect(db_url) as conn:
        return await queries.fetch_runs(conn, f, order=checked_order, limit=checked_limit)


def get_training_runs(
    db_url: str | None = None,
    *,
    limit: int | None = None,
    order: str = "newest",
    **filters: Unpack[RunFilters],
) -> list[TrainingRun]:
    """Sync :func:`get_training_runs_async`."""
    db = sync_database(db_url)
    return run_sync(lambda: get_training_runs_async(db, limit=limit, order=order, **filters))


async def count_training_runs_async(db_url: Database = None, **filters: Unpack[RunFilters]) -> int:
    f = Filters.build(**filters)
    async with connect(db_url) as conn:
        return await queries.count_runs(conn, f)


def count_training_runs(db_url: str | None = None, **filters: Unpack[RunFilters]) -> int:
    """Sync :func:`count_training_runs_async`."""
    db = sync_database(db_url)
    return run_sync(lambda: count_training_runs_async(db, **filters))
