"""A run's ``created`` event no longer notifies the API's streams.

Nobody can be streaming a run before the statement that creates it commits (its id is drawn
in that statement), so the notification woke every API process for nothing: each create cost
a notification per listening process, and a create-heavy load spent it on runs no stream
would ever follow. Every later event of the run notifies as before (migration 0010).

Revision ID: 0015
Revises: 0014
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# app.events.fanout.CHANNEL, written out as in 0010.
_CHANNEL = "trainyard_run_events"


def _function(where: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION run_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            r record;
        BEGIN
            FOR r IN SELECT run_id, min(id) AS first_id, max(id) AS last_id
                       FROM new_events {where} GROUP BY run_id LOOP
                PERFORM pg_notify(
                    '{_CHANNEL}', r.run_id::text || ':' || r.first_id || ':' || r.last_id
                );
            END LOOP;
            RETURN NULL;
        END
        $$
        """


def upgrade() -> None:
    op.execute(_function("WHERE type <> 'created'"))


def downgrade() -> None:
    op.execute(_function(""))
