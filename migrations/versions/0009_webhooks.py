"""Webhooks and their outbox, filled by triggers in the transaction that writes each event.

``webhooks`` are a project's endpoints; ``webhook_deliveries`` is the outbox the senders
(app/webhooks/delivery.py) drain after commit. The rows are written by triggers, not by the
writers of the events: a run's status events are inserted by one statement of the state
machine (app/runs/lifecycle/state.py) or of its fast path (app/runs/lifecycle/step_moves.py), and checkpoints
by app/checkpoints/service.py; a trigger on ``run_events`` and one on ``checkpoints`` serve
them all, so no writer can forget a webhook and no event commits without its delivery rows.
The triggers ``pg_notify`` the senders so a delivery does not wait for their timer.

The run-events trigger's ``WHEN`` clause keeps it off the hot path: the per-step events
(``step``, ``log`` …) never call the function.

Revision ID: 0009
Revises: 0008
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# app.webhooks.delivery.CHANNEL: the senders LISTEN on it.
_CHANNEL = "trainyard_webhooks_due"

# The status events that are webhook events (as run.<status>).
_STATUSES = "'completed', 'failed', 'cancelled', 'paused'"


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("project_id", sa.Uuid(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("event_types", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_webhooks_project_created", "webhooks", ["project_id", "created_at", "id"], unique=False
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Uuid(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("webhook_id", sa.Uuid(), nullable=False),
        sa.Column("event_type", sa.String(length=32), nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "next_attempt_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=True,
        ),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["webhook_id"], ["webhooks.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_webhook_deliveries_due",
        "webhook_deliveries",
        ["next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("next_attempt_at IS NOT NULL"),
    )
    op.create_index(
        "ix_webhook_deliveries_webhook_created",
        "webhook_deliveries",
        ["webhook_id", "created_at", "id"],
        unique=False,
    )
    # One delivery row per webhook of the run's project subscribed to the event; the
    # payload is the Standard Webhooks shape {type, timestamp, data}.
    op.execute(
        f"""
        CREATE FUNCTION webhooks_enqueue_run_event() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            kind text := 'run.' || (NEW.data ->> 'to');
        BEGIN
            INSERT INTO webhook_deliveries (webhook_id, event_type, payload)
            SELECT w.id, kind, jsonb_build_object(
                       'type', kind,
                       'timestamp', NEW.created_at,
                       'data', jsonb_build_object(
                           'run_id', r.id,
                           'project_id', r.project_id,
                           'status', NEW.data ->> 'to',
                           'previous_status', NEW.data ->> 'from',
                           'error', NEW.data -> 'error',
                           'message', NEW.message,
                           'step', r.step,
                           'event_id', NEW.id))
              FROM runs r JOIN webhooks w ON w.project_id = r.project_id
             WHERE r.id = NEW.run_id AND kind = ANY (w.event_types);
            IF FOUND THEN
                PERFORM pg_notify('{_CHANNEL}', '');
            END IF;
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER run_events_webhooks AFTER INSERT ON run_events FOR EACH ROW"
        f" WHEN (NEW.type = 'status' AND NEW.data ->> 'to' IN ({_STATUSES}))"
        " EXECUTE FUNCTION webhooks_enqueue_run_event()"
    )
    # An upsert of a checkpoint already recorded fires no INSERT trigger: one event per
    # checkpoint, however often its step is recorded again.
    op.execute(
        f"""
        CREATE FUNCTION webhooks_enqueue_checkpoint() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO webhook_deliveries (webhook_id, event_type, payload)
            SELECT w.id, 'checkpoint.saved', jsonb_build_object(
                       'type', 'checkpoint.saved',
                       'timestamp', NEW.created_at,
                       'data', jsonb_build_object(
                           'run_id', r.id,
                           'project_id', r.project_id,
                           'checkpoint_id', NEW.id,
                           'step', NEW.step,
                           'is_final', NEW.is_final,
                           'path', NEW.path,
                           'metrics', NEW.metrics))
              FROM runs r JOIN webhooks w ON w.project_id = r.project_id
             WHERE r.id = NEW.run_id AND 'checkpoint.saved' = ANY (w.event_types);
            IF FOUND THEN
                PERFORM pg_notify('{_CHANNEL}', '');
            END IF;
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER checkpoints_webhooks AFTER INSERT ON checkpoints FOR EACH ROW"
        " EXECUTE FUNCTION webhooks_enqueue_checkpoint()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER checkpoints_webhooks ON checkpoints")
    op.execute("DROP FUNCTION webhooks_enqueue_checkpoint()")
    op.execute("DROP TRIGGER run_events_webhooks ON run_events")
    op.execute("DROP FUNCTION webhooks_enqueue_run_event()")
    op.drop_index("ix_webhook_deliveries_webhook_created", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhooks_project_created", table_name="webhooks")
    op.drop_table("webhooks")
