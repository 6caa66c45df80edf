"""Episode calls: how long each waited for the engine (``queued_ms``).

A call's ``latency_ms`` is its time in the API and ``generation_ms`` the engine's time for
the generation that answered it; with a real engine a call also waits, in the run's inbox
and behind the generations before its own. ``queued_ms`` is that wait, so a call's latency
splits into waiting for the engine, generating, and the gateway's own path (the rest).

Revision ID: 0018
Revises: 0017
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "episode_calls",
        sa.Column("queued_ms", sa.Float(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("episode_calls", "queued_ms")
