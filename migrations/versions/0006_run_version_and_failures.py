"""A run's version is kept by PostgreSQL, and failed attempts are counted apart from claims.

``version`` (the ETag and compare-and-set token) counted every visible change of a run, but
four modules bumped it by hand. A ``BEFORE UPDATE`` trigger now bumps it (and
``updated_at``) whenever anything but the lease bookkeeping changes, so no writer can
forget it or bump it twice.

``attempt`` is the fencing token: it grows with every claim, pauses and resumes included.
The cap on attempts must count only failures — a lease that ran out without being given
back (a crash, a partition, a stopped process) — so those get a column of their own.

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Lease bookkeeping: renewals, releases and dispatches change nothing a client sees.
_NOT_VISIBLE = "'{version,updated_at,lease_owner,lease_expires_at,dispatched_at}'::text[]"


def upgrade() -> None:
    op.add_column("runs", sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
    op.execute(
        f"""
        CREATE FUNCTION runs_count_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF (to_jsonb(NEW) - {_NOT_VISIBLE}) IS DISTINCT FROM (to_jsonb(OLD) - {_NOT_VISIBLE})
            THEN
                NEW.version := OLD.version + 1;
                NEW.updated_at := now();
            ELSE
                NEW.version := OLD.version;
            END IF;
            RETURN NEW;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER runs_count_change BEFORE UPDATE ON runs"
        " FOR EACH ROW EXECUTE FUNCTION runs_count_change()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER runs_count_change ON runs")
    op.execute("DROP FUNCTION runs_count_change()")
    op.drop_column("runs", "failures")
