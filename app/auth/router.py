"""``GET /me``: which key is calling, for which project, and what it may do there, so a
client (the dashboard) can offer only what the key's role allows."""

from __future__ import annotations

from fastapi import APIRouter

from app.auth import service
from app.auth.deps import Caller, unauthorized
from app.auth.roles import Role
from app.auth.schemas import KeyRef, Me, ProjectRef
from app.core.deps import ReadSession
from app.core.errors import problem_responses

router = APIRouter(tags=["auth"])


@router.get(
    "/me",
    operation_id="get_me",
    response_model=Me,
    responses=problem_responses(401),
)
async def get_me(caller: Caller, session: ReadSession) -> Me:
    """The calling key: its id, label, first characters and role, and its project. Every
    role may ask."""
    found = await service.key_and_project(session, caller.key_id)
    if found is None:  # the key was deleted since the key cache last checked it
        raise unauthorized("Unknown or revoked API key.")
    key, project = found
    return Me(
        project=ProjectRef(id=project.id, name=project.name),
        # The role the request was let in with: the cached principal's, as every route sees.
        key=KeyRef(id=key.id, name=key.name, prefix=key.prefix, role=Role(caller.role)),
    )
