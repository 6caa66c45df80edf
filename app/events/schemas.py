from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from app.core.pagination import Page
from app.core.storable import StoredObject

# What a run's log holds, by who writes it: the API (created, imported: a JSONL import, status:
# every transition, cancel_requested, pause_requested, pause_withdrawn: a stop asked of the
# worker that holds the run), the control plane (lease: a worker's lease ran out), the
# workers (inputs, resume, sft, sft_step, step, eval, checkpoint, servers: the vLLM servers Ray
# placed for an attempt).
RUN_EVENT_TYPES = (
    "created",
    "imported",
    "status",
    "cancel_requested",
    "pause_requested",
    "pause_withdrawn",
    "lease",
    "inputs",
    "resume",
    "sft",
    "sft_step",
    "step",
    "eval",
    "checkpoint",
    "handover",
    "fork",
    "attempt_ended",
    "servers",
)
RUN_EVENT_LEVELS = ("info", "warning", "error")


def _documented_enum(values: tuple[str, ...]) -> WithJsonSchema:
    # Documented as an enum, served as a string: an event a newer worker writes must not
    # fail the page it is on.
    return WithJsonSchema({"type": "string", "enum": list(values)})


class RunEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    run_id: uuid.UUID
    type: Annotated[str, _documented_enum(RUN_EVENT_TYPES)] = Field(
        description="What happened; the stream's `event:` line says it too."
    )
    level: Annotated[str, _documented_enum(RUN_EVENT_LEVELS)]
    message: str
    data: StoredObject = Field(description="The event's details, as its type has them.")
    created_at: datetime


class RunEventsPage(Page[RunEventPublic]):
    """A page of RunEventPublic; pass ``next_cursor`` as ``after`` for the next."""
