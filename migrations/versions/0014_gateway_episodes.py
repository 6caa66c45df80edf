"""Gateway runs: ``episodes`` (one per rollout a harness plays) and ``episode_calls`` (every
model call of an episode, with the engine's token ids and log-probabilities packed as
little-endian int32 / float32 arrays).

Revision ID: 0014
Revises: 0013
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a migration says what the schema was when it was written.
_STATUSES = "'pending', 'claimed', 'finished', 'failed', 'dropped'"


def _now(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        server_default=None if nullable else sa.text("now()"),
        nullable=nullable,
    )


def _jsonb(name: str, default: str | None) -> sa.Column:
    return sa.Column(
        name,
        postgresql.JSONB(astext_type=sa.Text()),
        server_default=sa.text(f"'{default}'::jsonb") if default is not None else None,
        nullable=default is None,
    )


def upgrade() -> None:
    op.create_table(
        "episodes",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("phase", sa.String(length=8), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("group_index", sa.Integer(), nullable=False),
        sa.Column("rollout_index", sa.Integer(), nullable=False),
        sa.Column("task_input_id", sa.Uuid(), nullable=True),
        _jsonb("prompt", "[]"),
        _jsonb("context", "{}"),
        sa.Column("status", sa.String(length=12), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("issued", sa.Integer(), nullable=False),
        sa.Column("max_issues", sa.Integer(), nullable=False),
        sa.Column("max_calls", sa.Integer(), nullable=False),
        sa.Column("timeout_seconds", sa.Float(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=True),
        _now("claimed_at", nullable=True),
        _now("deadline", nullable=True),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        _jsonb("metrics", "{}"),
        _jsonb("messages", None),
        sa.Column("error", sa.Text(), nullable=True),
        _now("created_at"),
        _now("ended_at", nullable=True),
        sa.CheckConstraint(f"status IN ({_STATUSES})", name="ck_episodes_status"),
        sa.CheckConstraint("phase IN ('train', 'eval')", name="ck_episodes_phase"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["task_input_id"], ["task_inputs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "uq_episodes_run_phase_step_slot",
        "episodes",
        ["run_id", "phase", "step", "slot"],
        unique=True,
    )
    op.create_index(
        "ix_episodes_pending",
        "episodes",
        ["run_id", "created_at"],
        unique=False,
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "ix_episodes_run_created", "episodes", ["run_id", "created_at", "id"], unique=False
    )
    op.create_table(
        "episode_calls",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("episode_id", sa.Uuid(), nullable=False),
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("issue", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        _jsonb("request", "{}"),
        _jsonb("response", "{}"),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=False),
        sa.Column("completion_ids", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("generation_ms", sa.Float(), nullable=False),
        _now("created_at"),
        sa.ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "uq_episode_calls_episode_issue_seq",
        "episode_calls",
        ["episode_id", "issue", "seq"],
        unique=True,
    )
    op.create_index(
        "ix_episode_calls_run_created", "episode_calls", ["run_id", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_table("episode_calls")
    op.drop_table("episodes")
