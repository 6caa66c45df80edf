"""Run events notify the API's streams when they commit.

Every API process LISTENs on ``trainyard_run_events`` once (app/events/fanout.py) and fans new
events out to the streams of that run, instead of each stream polling. The trigger runs once
per statement and notifies once per run the statement wrote to, with the run's first and
last new event ids: ``<run id>:<first id>:<last id>``. Notifications are sent at commit, in commit order, and
not at all on rollback.

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# app.events.fanout.CHANNEL: the API processes LISTEN on it.
_CHANNEL = "trainyard_run_events"


def upgrade() -> None:
    op.execute(
        f"""
        CREATE FUNCTION run_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            r record;
        BEGIN
            FOR r IN SELECT run_id, min(id) AS first_id, max(id) AS last_id
                       FROM new_events GROUP BY run_id LOOP
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


def downgrade() -> None:
    op.execute("DROP TRIGGER run_events_notify ON run_events")
    op.execute("DROP FUNCTION run_events_notify()")
