"""Episodes: the calls of a claim are counted from their rows, not kept in a column.

``episodes.calls`` was raised by every call as it opened (a write and a commit before the
call reached the worker) and only read back by the episode listing. The worker that answers
a claim's calls now numbers them and holds them to ``max_calls``, and a call's row is its
record, so the listing counts the claim's rows (``uq_episode_calls_episode_issue_seq``
serves it) and a call costs the database one write instead of two (docs/benchmarks.md,
gateway).

Revision ID: 0017
Revises: 0016
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_column("episodes", "calls")


def downgrade() -> None:
    op.add_column("episodes", sa.Column("calls", sa.Integer(), nullable=False, server_default="0"))
    op.execute(
        """UPDATE episodes e SET calls = (SELECT count(*) FROM episode_calls c
                                           WHERE c.episode_id = e.id AND c.issue = e.issued)"""
    )
