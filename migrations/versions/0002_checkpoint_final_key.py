"""The final model may share its step with a resumable checkpoint.

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("uq_checkpoints_run_step", table_name="checkpoints")
    op.create_index(
        "uq_checkpoints_run_step_final",
        "checkpoints",
        ["run_id", "step", "is_final"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("uq_checkpoints_run_step_final", table_name="checkpoints")
    op.create_index("uq_checkpoints_run_step", "checkpoints", ["run_id", "step"], unique=True)
