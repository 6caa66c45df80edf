"""The gateway's REST routes: harnesses claim episodes and end them; anyone with a key of
the project reads them. (The OpenAI routes of each episode: app/gateway/openai_api.py.)"""

from __future__ import annotations

import time
import uuid
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.auth.deps import Caller, Member, unauthorized
from app.core.columns import INT32_MAX
from app.core.errors import problem_responses
from app.core.pagination import Paging, decode_cursor, make_page
from app.core.query import check_query_parameters
from app.gateway import service, tokens
from app.gateway.hub import GatewayHub
from app.gateway.models import EpisodeStatus
from app.gateway.schemas import (
    ClaimAnswer,
    ClaimedEpisode,
    ClaimRequest,
    EpisodeDetail,
    EpisodeEnded,
    EpisodeInput,
    EpisodePublic,
    EpisodesPage,
    FailBody,
    FinishBody,
)
from app.observability import prometheus

router = APIRouter(tags=["gateway"])

_episode_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="EpisodeToken",
    description="An episode's token (`tye_…`), from its claim.",
)


async def episode_token(
    episode_id: uuid.UUID,
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_episode_bearer)],
) -> str:
    """The hash of the request's episode token, if it names this episode; else 401/404.
    (``async``: a plain ``def`` would run on the thread pool, for every finish.)"""
    check_query_parameters(request)  # first, as for a key (app/core/query.py)
    if credentials is None:
        raise unauthorized("Send the episode's token as 'Authorization: Bearer tye_…'.")
    parsed = tokens.parse(credentials.credentials)
    if parsed is None:
        raise unauthorized("Not an episode token.")
    named, digest = parsed
    if named != episode_id:
        raise service.EpisodeNotFound()
    return digest


EpisodeToken = Annotated[str, Depends(episode_token)]


def hub(request: Request) -> GatewayHub:
    return request.app.state.gateway


def base_url(request: Request, episode_id: uuid.UUID) -> str:
    return f"{str(request.base_url).rstrip('/')}/gateway/episodes/{episode_id}/v1"


@router.post(
    "/runs/{run_id}/episodes/claim",
    operation_id="claim_episodes",
    response_model=ClaimAnswer,
    responses=problem_responses(401, 403, 404, 409, 422),
)
async def claim_episodes(
    run_id: uuid.UUID,
    request: Request,
    caller: Member,
    body: Annotated[ClaimRequest | None, Body()] = None,
) -> ClaimAnswer:
    """Take up to ``max`` of the run's waiting episodes, waiting up to ``wait_seconds`` for
    one (a long poll). Each comes with its OpenAI base URL and a token that opens only it;
    end each with its finish (or fail) before its deadline. 409 for a run that is not a
    gateway run."""
    body = body or ClaimRequest()
    pg = request.app.state.pg
    until = time.monotonic() + body.wait_seconds
    while True:
        run = await service.run_of(pg, run_id, caller.project_id)
        if run["environment_type"] != "gateway":
            raise service.NotAGatewayRun(
                "The run is not a gateway run (environment.type 'gateway'): it has no episodes."
            )
        claimed = (
            [] if service.run_is_over(run["status"]) else await service.claim(pg, run_id, body.max)
        )
        left = until - time.monotonic()
        if claimed or left <= 0 or service.run_is_over(run["status"]):
            break
        await hub(request).wait_available(run_id, left)
    prometheus.GATEWAY_EPISODES.labels("claimed").inc(len(claimed))
    return ClaimAnswer(
        run_status=run["status"],
        episodes=[
            ClaimedEpisode(
                id=row["id"],
                run_id=run_id,
                phase=row["phase"],
                step=row["step"],
                group_index=row["group_index"],
                rollout_index=row["rollout_index"],
                issue=row["issued"],
                input=EpisodeInput(
                    id=row["task_input_id"],
                    text=_input_text(prompt := service.json_list(row["prompt"])),
                    context=service.json_object(row["context"]),
                ),
                messages=prompt,
                base_url=base_url(request, row["id"]),
                token=token,
                deadline=row["deadline"],
            )
            for row, token in claimed
        ],
    )


def _input_text(prompt: list[dict[str, object]]) -> str:
    return str(prompt[-1].get("content", "")) if prompt else ""


@router.post(
    "/episodes/{episode_id}/finish",
    operation_id="finish_episode",
    response_model=EpisodeEnded,
    responses=problem_responses(401, 404, 409, 422),
)
async def finish_episode(
    episode_id: uuid.UUID, body: FinishBody, request: Request, token: EpisodeToken
) -> EpisodeEnded:
    """End the episode with its reward (null: none). 409 when its claim was taken back at
    the deadline or it already ended; 404 for an episode the token does not open."""
    request.app.state.claims.forget(episode_id, token)
    run_id, issue = await service.end(
        request.app.state.pg,
        episode_id,
        token,
        status=EpisodeStatus.finished,
        reward=body.reward,
        metrics=body.metrics,
        messages=body.messages,
    )
    await hub(request).ended(run_id, episode_id, issue)
    prometheus.GATEWAY_EPISODES.labels("finished").inc()
    return EpisodeEnded(id=episode_id, status=EpisodeStatus.finished)


@router.post(
    "/episodes/{episode_id}/fail",
    operation_id="fail_episode",
    response_model=EpisodeEnded,
    responses=problem_responses(401, 404, 409, 422),
)
async def fail_episode(
    episode_id: uuid.UUID, body: FailBody, request: Request, token: EpisodeToken
) -> EpisodeEnded:
    """End the episode as failed: it has no reward, and is not handed out again."""
    request.app.state.claims.forget(episode_id, token)
    run_id, issue = await service.end(
        request.app.state.pg, episode_id, token, status=EpisodeStatus.failed, error=body.error
    )
    await hub(request).ended(run_id, episode_id, issue)
    prometheus.GATEWAY_EPISODES.labels("failed").inc()
    return EpisodeEnded(id=episode_id, status=EpisodeStatus.failed)


@router.get(
    "/runs/{run_id}/episodes",
    operation_id="list_episodes",
    response_model=EpisodesPage,
    responses=problem_responses(401, 404, 422),
)
async def list_episodes(
    run_id: uuid.UUID,
    request: Request,
    caller: Caller,
    page: Paging,
    step: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    status: EpisodeStatus | None = None,
) -> dict[str, object]:
    """The run's episodes, oldest first."""
    pg = request.app.state.pg
    await service.run_of(pg, run_id, caller.project_id)
    scope = (run_id, step, status)
    after = None
    if page.after:
        created, last_id = decode_cursor(
            page.after, datetime.fromisoformat, uuid.UUID, of="list_episodes", scope=scope
        )
        after = (created, last_id)
    rows = await service.list_episodes(
        pg,
        run_id,
        step=step,
        status=status.value if status else None,
        after=after,
        limit=page.limit + 1,
    )
    return make_page(
        rows,
        page.limit,
        lambda r: (r["created_at"].isoformat(), str(r["id"])),
        EpisodePublic.model_validate,
        of="list_episodes",
        scope=scope,
    )


@router.get(
    "/episodes/{episode_id}",
    operation_id="get_episode",
    response_model=EpisodeDetail,
    responses=problem_responses(401, 404, 422),
)
async def get_episode(
    episode_id: uuid.UUID,
    request: Request,
    caller: Caller,
    tokens_: Annotated[
        bool, Query(alias="tokens", description="Include each call's token ids and logprobs.")
    ] = False,
) -> EpisodeDetail:
    """One episode with every call it made: the request, the answer, the policy version,
    the latency, and with ``tokens=true`` the engine's token ids and log-probabilities."""
    row = await service.episode_detail(
        request.app.state.pg, episode_id, caller.project_id, with_tokens=tokens_
    )
    return EpisodeDetail.model_validate(row)
