"""Projects own runs; API keys belong to exactly one project and are stored hashed."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, Column, ForeignKey, Index, String, Uuid, text
from sqlmodel import Field, SQLModel

from app.auth.roles import ROLE_VALUES, Role
from app.core.columns import timestamp


class Project(SQLModel, table=True):
    __tablename__ = "projects"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    name: str = Field(max_length=200, unique=True)
    created_at: datetime | None = Field(default=None, sa_column=timestamp())


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_keys"
    __table_args__ = (
        Index("ix_api_keys_project", "project_id", "created_at"),
        CheckConstraint(f"role IN ({ROLE_VALUES})", name="ck_api_keys_role"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    project_id: uuid.UUID = Field(
        sa_column=Column(Uuid, ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    )
    name: str | None = Field(default=None, max_length=200)
    # First characters of the key, shown in listings so people can tell keys apart.
    prefix: str = Field(max_length=32)
    key_hash: str = Field(max_length=64, unique=True)
    # What the key may do in its project (app/auth/roles.py). The server default is for the
    # keys made before roles existed; create_key always says which role it makes.
    role: Role = Field(
        default=Role.admin,
        sa_column=Column(String(16), nullable=False, server_default=text("'admin'")),
    )
    created_at: datetime | None = Field(default=None, sa_column=timestamp())
    last_used_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
    revoked_at: datetime | None = Field(
        default=None, sa_column=timestamp(nullable=True, default_now=False)
    )
