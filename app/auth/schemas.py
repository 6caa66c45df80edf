"""What ``GET /me`` answers: the calling key, its project and its role."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, Field

from app.auth.roles import Role


class ProjectRef(BaseModel):
    id: uuid.UUID
    name: str


class KeyRef(BaseModel):
    id: uuid.UUID = Field(description="The key's id, as `trainyard keys list` shows it.")
    name: str | None = Field(description="The key's label, if it was given one.")
    prefix: str = Field(description="The key's first characters (never the key itself).")
    role: Role = Field(
        description="What the key may do in its project: `viewer` reads, `member` also "
        "creates and controls runs and uploads datasets, `admin` also manages webhooks."
    )


class Me(BaseModel):
    """The key a request was made with."""

    project: ProjectRef
    key: KeyRef
