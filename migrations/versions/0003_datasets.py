"""Uploaded datasets and their rows; runs may name the dataset their inputs came from.

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("project_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("num_rows", sa.Integer(), nullable=False),
        sa.Column("num_train_rows", sa.Integer(), nullable=False),
        sa.Column("num_validation_rows", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_datasets_project_created", "datasets", ["project_id", "created_at", "id"], unique=False
    )
    op.create_table(
        "dataset_rows",
        sa.Column("dataset_id", sa.Uuid(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("input_text", sa.Text(), nullable=False),
        sa.Column("context", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("split", sa.String(length=16), nullable=False),
        sa.CheckConstraint("split IN ('train', 'validation')", name="ck_dataset_rows_split"),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("dataset_id", "index"),
    )
    op.create_index(
        "ix_dataset_rows_split", "dataset_rows", ["dataset_id", "split", "index"], unique=False
    )
    # Nullable, no default: adding it rewrites nothing, whatever the size of runs.
    op.add_column("runs", sa.Column("dataset_id", sa.Uuid(), nullable=True))
    op.create_foreign_key(
        "runs_dataset_id_fkey", "runs", "datasets", ["dataset_id"], ["id"], ondelete="SET NULL"
    )


def downgrade() -> None:
    op.drop_constraint("runs_dataset_id_fkey", "runs", type_="foreignkey")
    op.drop_column("runs", "dataset_id")
    op.drop_index("ix_dataset_rows_split", table_name="dataset_rows")
    op.drop_table("dataset_rows")
    op.drop_index("ix_datasets_project_created", table_name="datasets")
    op.drop_table("datasets")
