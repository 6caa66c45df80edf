"""Trajectories carry their run's project and learning key, indexed for training-data queries.

Both are copied from the run when a trajectory is written and never change (a run's project
and learning key are fixed at creation), so the training-data filters and the keyset order
``(created_at, id)`` are served by one index each, with no join to ``runs``.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trajectories", sa.Column("project_id", sa.Uuid(), nullable=True))
    op.add_column("trajectories", sa.Column("learning_key", sa.String(length=200), nullable=True))
    op.execute(
        "UPDATE trajectories AS t SET project_id = r.project_id, learning_key = r.learning_key"
        " FROM runs AS r WHERE r.id = t.run_id"
    )
    op.alter_column("trajectories", "project_id", nullable=False)
    op.create_foreign_key(
        "trajectories_project_id_fkey",
        "trajectories",
        "projects",
        ["project_id"],
        ["id"],
        ondelete="CASCADE",
    )
    # A project's trajectories newest first, with the reward in the index so counts by
    # reward and date are index-only.
    op.create_index(
        "ix_trajectories_project_created",
        "trajectories",
        ["project_id", "created_at", "id"],
        postgresql_include=["reward"],
    )
    # Every project's, for the library's queries that name no project.
    op.create_index("ix_trajectories_created", "trajectories", ["created_at", "id"])
    op.create_index(
        "ix_trajectories_learning_key_created",
        "trajectories",
        ["learning_key", "created_at", "id"],
        postgresql_where=sa.text("learning_key IS NOT NULL"),
    )
    op.create_index("ix_trajectories_run_created", "trajectories", ["run_id", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_trajectories_run_created", table_name="trajectories")
    op.drop_index("ix_trajectories_learning_key_created", table_name="trajectories")
    op.drop_index("ix_trajectories_created", table_name="trajectories")
    op.drop_index("ix_trajectories_project_created", table_name="trajectories")
    op.drop_column("trajectories", "learning_key")
    op.drop_column("trajectories", "project_id")
