"""A run may be ``warming_up``: an agent run's SFT warm-up, before its first GRPO step.

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = (
    "'pending', 'generating', 'collecting', 'scoring', 'training', 'paused', 'completed', "
    "'failed', 'cancelled'"
)
_AFTER = _BEFORE + ", 'warming_up'"


def upgrade() -> None:
    op.drop_constraint("ck_runs_status", "runs", type_="check")
    op.create_check_constraint("ck_runs_status", "runs", f"status IN ({_AFTER})")


def downgrade() -> None:
    op.execute("UPDATE runs SET status = 'generating' WHERE status = 'warming_up'")
    op.drop_constraint("ck_runs_status", "runs", type_="check")
    op.create_check_constraint("ck_runs_status", "runs", f"status IN ({_BEFORE})")
