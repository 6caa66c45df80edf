"""Run events notify per row, and a run's ``created`` event skips the trigger altogether.

The statement-level trigger of 0010 read its rows from a transition table: every insert into
``run_events`` (a run's creation included, though 0015 made it notify nobody) paid for the
table being filled, a PL/pgSQL call and a grouped query over it. A row-level trigger whose
``WHEN`` leaves ``created`` out is never called for a creation, and for any other event costs
one call. In-process, 3,000 creates against one database: about 150 µs less of PostgreSQL's
CPU per create (docs/benchmarks.md).

The payload keeps its shape, ``<run id>:<first id>:<last id>``, with first and last the row's
own id: a statement that appends several events of a run (a move's status and step) sends one
notification each, which the API's event hub gathers into one read (app/events/fanout.py).

Revision ID: 0016
Revises: 0015
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# app.events.fanout.CHANNEL, written out as in 0010.
_CHANNEL = "trainyard_run_events"


def upgrade() -> None:
    op.execute("DROP TRIGGER run_events_notify ON run_events")
    op.execute("DROP FUNCTION run_events_notify()")
    op.execute(
        f"""
        CREATE FUNCTION run_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{_CHANNEL}', NEW.run_id::text || ':' || NEW.id || ':' || NEW.id);
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER run_event_notify AFTER INSERT ON run_events FOR EACH ROW"
        " WHEN (NEW.type <> 'created') EXECUTE FUNCTION run_event_notify()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER run_event_notify ON run_events")
    op.execute("DROP FUNCTION run_event_notify()")
    op.execute(
        f"""
        CREATE FUNCTION run_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            r record;
        BEGIN
            FOR r IN SELECT run_id, min(id) AS first_id, max(id) AS last_id
                       FROM new_events WHERE type <> 'created' GROUP BY run_id LOOP
                PERFORM pg_notify(
                    '{_CHANNEL}', r.run_id::text || ':' || r.first_id || ':' || r.last_id
                );
            END LOOP;
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER run_events_notify AFTER INSERT ON run_events"
        " REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT"
        " EXECUTE FUNCTION run_events_notify()"
    )
