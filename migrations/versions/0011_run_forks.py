"""A run can start from another run's checkpoint: ``parent_run_id`` and ``parent_step`` say
which (``POST /runs`` with ``from_checkpoint``). A parent that is deleted leaves its forks
with the step and no parent.

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column(
            "parent_run_id",
            sa.Uuid(),
            sa.ForeignKey("runs.id", ondelete="SET NULL"),
            nullable=True,
        ),
    )
    op.add_column("runs", sa.Column("parent_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "parent_step")
    op.drop_column("runs", "parent_run_id")
