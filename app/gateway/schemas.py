"""The gateway's request bodies and answers (its REST routes; the OpenAI routes speak
OpenAI's shapes, app/gateway/openai_api.py)."""

from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel, Field

from app.core.limits import MAX_CALL_MESSAGES
from app.core.pagination import Page
from app.core.storable import NulFreeStr, PolicyTextObject, RequestModel, StoredObject
from app.gateway.models import EpisodeStatus

MAX_CLAIM = 64  # the SDK asks for no more (sdk/python/src/trainyard/client.py)
MAX_WAIT_SECONDS = 30.0


class ClaimRequest(RequestModel):
    max: int = Field(default=1, ge=1, le=MAX_CLAIM, description="The most episodes to take.")
    wait_seconds: float = Field(
        default=20.0,
        ge=0,
        le=MAX_WAIT_SECONDS,
        description="How long to wait for an episode when none waits now (long poll).",
    )


class EpisodeInput(BaseModel):
    id: uuid.UUID | None = Field(description="The run's input (GET /runs/{id}/inputs).")
    text: str
    context: StoredObject


class ClaimedEpisode(BaseModel):
    id: uuid.UUID
    run_id: uuid.UUID
    phase: str = Field(description="'train', or 'eval' for a validation rollout.")
    step: int
    group_index: int
    rollout_index: int
    issue: int = Field(description="Which claim of the episode this is (1: the first).")
    input: EpisodeInput
    messages: list[StoredObject] = Field(
        description="The run's prompt for the input: its system prompt, if any, and the input "
        "as the user's message."
    )
    base_url: str = Field(description="The episode's OpenAI base URL (…/v1).")
    token: str = Field(
        description="Opens this claim of this episode only: the OpenAI API key of base_url, "
        "and the key of its finish and fail."
    )
    deadline: datetime = Field(description="When the claim is taken back, unfinished.")


class ClaimAnswer(BaseModel):
    episodes: list[ClaimedEpisode]
    run_status: str = Field(
        description="The run's status now: once it is completed, failed or cancelled no "
        "episode will come."
    )


class FinishBody(RequestModel):
    reward: float | None = Field(
        description="The episode's reward; null: none (the rollout is dropped, like one a "
        "judge could not score)."
    )
    metrics: dict[NulFreeStr, float] = Field(
        default_factory=dict,
        max_length=100,
        description="Numbers about the episode to keep with it (turns, tests passed, …).",
    )
    messages: list[PolicyTextObject] | None = Field(
        default=None,
        max_length=MAX_CALL_MESSAGES,
        description="The episode's conversation as the harness ends it, to store with the "
        "trajectory (a NUL character the policy wrote is stored as U+FFFD); unset: its last "
        "call's messages and answer.",
    )


class FailBody(RequestModel):
    error: NulFreeStr = Field(min_length=1, max_length=4000, description="What went wrong.")


class EpisodeEnded(BaseModel):
    id: uuid.UUID
    status: EpisodeStatus


class CallPublic(BaseModel):
    id: uuid.UUID
    issue: int
    seq: int
    policy_version: int = Field(description="The optimizer steps the answering weights had taken.")
    request: StoredObject
    response: StoredObject
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    generation_ms: float = Field(description="The engine's generation that answered it.")
    queued_ms: float = Field(
        description="Its wait for the engine: in the run's inbox while the worker answered "
        "the calls before it, then its batch's prompts rendered and the generations before its "
        "own. The rest of `latency_ms` is the gateway's own path."
    )
    created_at: datetime
    prompt_ids: list[int] | None = Field(default=None, description="With tokens=true.")
    completion_ids: list[int] | None = Field(default=None, description="With tokens=true.")
    logprobs: list[float] | None = Field(default=None, description="With tokens=true.")


class EpisodePublic(BaseModel):
    id: uuid.UUID
    run_id: uuid.UUID
    phase: str
    step: int
    group_index: int
    rollout_index: int
    task_input_id: uuid.UUID | None
    status: EpisodeStatus
    attempt: int
    issued: int
    calls: int = Field(description="Calls made under the current (or last) claim.")
    reward: float | None
    metrics: StoredObject
    error: str | None
    deadline: datetime | None
    created_at: datetime
    ended_at: datetime | None


class EpisodeDetail(EpisodePublic):
    prompt: list[StoredObject]
    context: StoredObject
    messages: list[StoredObject] | None
    call_log: list[CallPublic] = Field(description="Every call, of every claim, in order.")


class EpisodesPage(Page[EpisodePublic]):
    pass
