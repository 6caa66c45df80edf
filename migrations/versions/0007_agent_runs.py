"""Runs can train agents: where they act (``environment``) and a supervised warm-up
(``sft``).

Both are jsonb written from their request models (app/runs/spec/environments.py,
app/runs/spec/sft.py) and null on every run that has neither: a single-turn run without tools
reads exactly as before.

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("environment", postgresql.JSONB(), nullable=True))
    op.add_column("runs", sa.Column("sft", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "sft")
    op.drop_column("runs", "environment")
