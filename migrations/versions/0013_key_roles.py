"""API keys get a role in their project: ``viewer``, ``member`` or ``admin``.

Every key made before this revision could do everything, so it becomes ``admin``: the
server default fills the column for them, and stays for any row inserted without a role
(``create_key`` always names one). The values are app.auth.roles.Role's, in a CHECK
constraint, as ``runs.status`` keeps its values.

Revision ID: 0013
Revises: 0012
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a migration says what the schema was when it was written.
_ROLES = "'viewer', 'member', 'admin'"


def upgrade() -> None:
    op.add_column(
        "api_keys",
        sa.Column("role", sa.String(length=16), server_default=sa.text("'admin'"), nullable=False),
    )
    op.create_check_constraint("ck_api_keys_role", "api_keys", f"role IN ({_ROLES})")


def downgrade() -> None:
    op.drop_constraint("ck_api_keys_role", "api_keys", type_="check")
    op.drop_column("api_keys", "role")
