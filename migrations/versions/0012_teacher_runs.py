"""Teacher runs: a run's ``teacher`` settings, and each input's student probe.

``runs.teacher`` is jsonb written from its request model (app/runs/spec/teacher.py), null on
every run that is not a teacher run. ``task_inputs.teacher`` is what the worker learnt about
the student on that input before the first step (its baseline answer and score, its
diagnostic probe, the teacher's prompt): null until then, and on every other run's inputs.

Revision ID: 0012
Revises: 0011
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("teacher", postgresql.JSONB(), nullable=True))
    op.add_column("task_inputs", sa.Column("teacher", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("task_inputs", "teacher")
    op.drop_column("runs", "teacher")
