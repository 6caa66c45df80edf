"""The gateway's work on the database: claims, finishes, failures, the recorded calls, and
what the episode routes read. Plain asyncpg statements, one per action (a claim or a call
is on every harness's hot path).

Every change of an episode's status is written here: the API's claims and ends, and the
worker's (workers/gateway/rollouts.py) opening of a step's episodes and taking back of
claims past their deadline."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from cachetools import TLRUCache

from app.core import jsontext
from app.core.domain import Conflict, NotFound
from app.gateway import tokens, wire
from app.gateway.models import EpisodeStatus
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.status import TERMINAL, RunStatus


class EpisodeNotFound(NotFound):
    def __init__(self) -> None:
        super().__init__("Episode", "Episode not found (or the token does not open it).")


class NotAGatewayRun(Conflict):
    """Episodes are claimed from gateway runs only: another run never has any, and a
    harness pointed at it would wait out every long poll."""

    code = "not-a-gateway-run"


class EpisodeNotOpen(Conflict):
    """The episode's claim is no longer the token's: it ended, or was taken back."""

    code = "episode-not-open"


_RUN = """SELECT status, model_name, environment->>'type' AS environment_type
             FROM runs WHERE id = $1 AND project_id = $2"""

# Claim up to $3 pending episodes of run $1, oldest first; $2: one new secret's hash each.
_CLAIM = """
    WITH picked AS (
        SELECT id, row_number() OVER (ORDER BY created_at, slot) AS n
          FROM (SELECT id, created_at, slot FROM episodes
                 WHERE run_id = $1 AND status = 'pending'
                 ORDER BY created_at, slot
                 LIMIT $3 FOR UPDATE SKIP LOCKED) AS p
    ), hashed AS (
        SELECT picked.id, h.hash, picked.n
          FROM picked JOIN unnest($2::text[]) WITH ORDINALITY AS h(hash, n) USING (n)
    )
    UPDATE episodes AS e
       SET status = 'claimed', issued = e.issued + 1, token_hash = hashed.hash,
           claimed_at = now(), deadline = now() + make_interval(secs => e.timeout_seconds)
      FROM hashed
     WHERE e.id = hashed.id
    RETURNING e.id, e.phase, e.step, e.group_index, e.rollout_index, e.issued,
              e.task_input_id, e.prompt, e.context, e.deadline, hashed.n
"""

_END = """
    UPDATE episodes
       SET status = $3, reward = $4, metrics = ($5::text)::jsonb, messages = ($6::text)::jsonb,
           error = $7, token_hash = NULL, ended_at = now()
     WHERE id = $1 AND token_hash = $2 AND status = 'claimed' AND deadline > now()
    RETURNING run_id, issued
"""

# A claim's first call reads it (then :class:`Claims` keeps it): the claim must be the
# token's and live. The worker that answers numbers the claim's calls and holds them to
# max_calls (workers/gateway/rollouts.py), and the call's row is the record, written only
# while the claim is still the token's: a call costs the database one write.
_RUN_OVER = ", ".join(sorted(f"'{status.value}'" for status in TERMINAL))

_CALL_OPENS = f"""
    SELECT e.run_id, e.phase, e.step, e.issued, e.slot,
           extract(epoch FROM e.deadline - now()) AS seconds_left
      FROM episodes e JOIN runs r ON r.id = e.run_id
     WHERE e.id = $1 AND e.token_hash = $2 AND e.status = 'claimed' AND e.deadline > now()
       AND r.status NOT IN ({_RUN_OVER})
"""

_WHY_NOT = """
    SELECT e.status, e.token_hash = $2 AS ours, e.deadline > now() AS live,
           r.status AS run_status
      FROM episodes e JOIN runs r ON r.id = e.run_id WHERE e.id = $1
"""

_RECORD = """
    INSERT INTO episode_calls (id, episode_id, run_id, issue, seq, policy_version, request,
                               response, prompt_ids, completion_ids, logprobs, latency_ms,
                               generation_ms, queued_ms)
    SELECT $1, $2, $3, $4, $5, $6, ($7::text)::jsonb, ($8::text)::jsonb, $9, $10, $11, $12, $13,
           $15
     WHERE EXISTS (SELECT 1 FROM episodes
                    WHERE id = $2 AND token_hash = $14 AND issued = $4 AND status = 'claimed'
                      AND deadline > now())
"""


# The worker's: a step's episodes (re)opened, fenced on its lease. A row an earlier attempt
# left is handed out again unless it ended ($5: the attempt resumed from the weights its
# calls came from, $6 their policy version). ``issued`` goes on counting: the next claim is
# a claim of its own, and the calls made under the lost attempt's stay under theirs.
_OPEN_RESET = """
    UPDATE episodes AS e
       SET status = 'pending', attempt = $4, token_hash = NULL,
           claimed_at = NULL, deadline = NULL, reward = NULL, metrics = '{}'::jsonb,
           messages = NULL, error = NULL, ended_at = NULL
      FROM (SELECT id, status FROM episodes
             WHERE run_id = $1 AND phase = $2 AND step = $3 AND attempt <> $4) AS was
     WHERE e.id = was.id
       AND NOT (e.status IN ('finished', 'failed', 'dropped') AND $5::int <= $6::int
                AND NOT EXISTS (SELECT 1 FROM episode_calls c
                                 WHERE c.episode_id = e.id AND c.issue = e.issued
                                   AND c.policy_version NOT BETWEEN $5 AND $6))
       AND EXISTS (SELECT 1 FROM runs r WHERE r.id = $1 AND r.lease_owner = $7
                                          AND r.attempt = $4)
    RETURNING was.status
"""

_OPEN_INSERT = """
    INSERT INTO episodes (id, run_id, phase, step, slot, group_index, rollout_index,
                          task_input_id, prompt, context, status, attempt, issued, max_issues,
                          max_calls, timeout_seconds, metrics)
    SELECT gen_random_uuid(), $1, $2, $3, r.slot, r.group_index, r.rollout_index,
           r.task_input_id, r.prompt, r.context, 'pending', $4, 0, $5, $6, $7, '{}'::jsonb
      FROM jsonb_to_recordset(($8::text)::jsonb)
           AS r(slot int, group_index int, rollout_index int, task_input_id uuid,
                prompt jsonb, context jsonb)
     WHERE EXISTS (SELECT 1 FROM runs WHERE id = $1 AND lease_owner = $9 AND attempt = $4)
    ON CONFLICT (run_id, phase, step, slot) DO NOTHING
"""

_EXPIRE = """
    UPDATE episodes
       SET status = CASE WHEN issued >= max_issues THEN 'dropped' ELSE 'pending' END,
           token_hash = NULL,
           error = CASE WHEN issued >= max_issues
                        THEN format('handed out %s times, never finished within %s s',
                                    issued, timeout_seconds)
                        ELSE error END,
           ended_at = CASE WHEN issued >= max_issues THEN now() END
     WHERE run_id = $1 AND phase = $2 AND step = $3 AND status = 'claimed'
       AND deadline <= now()
    RETURNING status
"""


async def run_of(pg: asyncpg.Pool, run_id: uuid.UUID, project_id: uuid.UUID) -> asyncpg.Record:
    row = await pg.fetchrow(_RUN, run_id, project_id)
    if row is None:
        raise NotFound("Run")
    return row


async def claim(pg: asyncpg.Pool, run_id: uuid.UUID, n: int) -> list[tuple[asyncpg.Record, str]]:
    """Claim up to ``n`` pending episodes of the run: each with its new token."""
    secrets_ = [tokens.new_secret() for _ in range(n)]
    rows = await pg.fetch(_CLAIM, run_id, [tokens.digest(s) for s in secrets_], n)
    return [(row, tokens.token(row["id"], secrets_[row["n"] - 1])) for row in rows]


async def open_step(
    conn: asyncpg.Connection,
    run_id: uuid.UUID,
    phase: str,
    step: int,
    fence: Fence,
    *,
    reuse: tuple[int, int] | None,
    limits: tuple[int, int, float],
    rows: list[dict[str, Any]],
) -> int:
    """One ``pending`` episode per rollout of the step (``rows``: slot, group and rollout
    index, input, prompt, context), in one transaction; ``limits``: max_issues, max_calls,
    timeout_seconds. An episode an earlier attempt left is kept when it ended and every
    call of its last claim came from a policy version in ``reuse`` (lowest, highest: the
    versions this attempt's history holds, within an asynchronous run's bound); any other
    is handed out again. Returns how many ended episodes were handed out again (discarded)."""
    low, high = reuse if reuse is not None else (1, 0)  # an empty range: none kept
    async with conn.transaction():
        was = await conn.fetch(
            _OPEN_RESET, run_id, phase, step, fence.attempt, low, high, fence.owner
        )
        await conn.execute(
            _OPEN_INSERT,
            run_id,
            phase,
            step,
            fence.attempt,
            *limits,
            jsontext.dumps(rows),
            fence.owner,
        )
    return sum(1 for row in was if not EpisodeStatus(row["status"]).open)


async def expire_claims(
    conn: asyncpg.Connection, run_id: uuid.UUID, phase: str, step: int
) -> list[EpisodeStatus]:
    """Take back the step's claims past their deadline: each episode ``pending`` again, or
    ``dropped`` once handed out max_issues times; their new statuses."""
    return [EpisodeStatus(r["status"]) for r in await conn.fetch(_EXPIRE, run_id, phase, step)]


def run_is_over(status: str) -> bool:
    return RunStatus(status).is_terminal


async def end(
    pg: asyncpg.Pool,
    episode_id: uuid.UUID,
    token_hash: str,
    *,
    status: str,
    reward: float | None = None,
    metrics: dict[str, float] | None = None,
    messages: list[dict[str, Any]] | None = None,
    error: str | None = None,
) -> tuple[uuid.UUID, int]:
    """End the token's claim of the episode (finished or failed); the run's id and the
    claim's number (the episode's ``issued``)."""
    ended = await pg.fetchrow(
        _END,
        episode_id,
        token_hash,
        status,
        reward,
        jsontext.dumps(metrics or {}),
        None if messages is None else jsontext.dumps(messages),
        error,
    )
    if ended is None:
        await why_not(pg, episode_id, token_hash)
    return ended["run_id"], ended["issued"]


async def why_not(pg: asyncpg.Pool, episode_id: uuid.UUID, token_hash: str) -> None:
    """Raise what keeps the token's claim of the episode from acting: not found (or a token
    of another episode), or not open any more."""
    row = await pg.fetchrow(_WHY_NOT, episode_id, token_hash)
    if row is None:
        raise EpisodeNotFound()
    if run_is_over(row["run_status"]) and row["status"] not in ("finished", "failed"):
        # Still open when its run ended, and dropped with it (ENDED_WITH_RUN).
        raise EpisodeNotOpen(f"The episode's run has ended ({row['run_status']}).")
    if row["status"] in ("finished", "failed", "dropped"):
        raise EpisodeNotOpen(f"The episode has ended ({row['status']}).")
    if not row["ours"] or not row["live"]:
        raise EpisodeNotOpen(
            "The claim of this token was taken back at its deadline; the episode is handed "
            "out again (claim it anew)."
        )
    raise EpisodeNotOpen("The episode is not open.")


@dataclass(frozen=True)
class Claim:
    """A token's live claim of an episode, as a call needs it: the run, the episode's phase,
    step and slot in it, the claim's number (``issued``) and its deadline."""

    run_id: uuid.UUID
    phase: str
    step: int
    issued: int
    slot: int
    deadline: float  # time.monotonic()

    @property
    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class Claims:
    """This API process's live claims, by episode and token hash: a claim's first call reads
    it, the calls after it read nothing (a read before every call was a third of the
    gateway's own cost, and most of its tail waiting for a pooled connection).

    An entry leaves at the claim's deadline, when this process ends the episode, or when a
    call's record finds the claim gone (ended through another API process, or taken back by
    a worker's new attempt): the call's row is written only while the claim is the token's
    (``_RECORD``), so a call on a claim taken back since is answered 409 and recorded
    nowhere; the generation it cost is the price."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._live: TLRUCache[tuple[uuid.UUID, str], Claim] = TLRUCache(
            max_entries, ttu=lambda _key, claim, _now: claim.deadline
        )

    async def open(self, pg: asyncpg.Pool, episode_id: uuid.UUID, token_hash: str) -> Claim:
        """The token's live claim a call is made under (EpisodeNotFound, EpisodeNotOpen)."""
        claim = self._live.get((episode_id, token_hash))
        if claim is not None:
            return claim
        row = await pg.fetchrow(_CALL_OPENS, episode_id, token_hash)
        if row is None:
            await why_not(pg, episode_id, token_hash)
        claim = Claim(
            row["run_id"],
            row["phase"],
            row["step"],
            row["issued"],
            row["slot"],
            time.monotonic() + float(row["seconds_left"]),
        )
        self._live[(episode_id, token_hash)] = claim
        return claim

    async def recheck(self, pg: asyncpg.Pool, episode_id: uuid.UUID, token_hash: str) -> None:
        """Read the claim again (a call that has waited a while for its answer): raises as
        :meth:`open` does once the claim is gone (ended, taken back, its run over)."""
        self.forget(episode_id, token_hash)
        await self.open(pg, episode_id, token_hash)

    def forget(self, episode_id: uuid.UUID, token_hash: str) -> None:
        self._live.pop((episode_id, token_hash), None)


@dataclass(frozen=True)
class Answered:
    """A call answered by the policy and recorded: what each API's answer is made of."""

    call_id: uuid.UUID
    message: dict[str, Any]  # OpenAI's assistant message (content, tool_calls)
    finish: str  # "stop", "length" or "tool_calls"
    usage: dict[str, int]  # prompt_tokens, completion_tokens, total_tokens
    policy_version: int
    episode_id: uuid.UUID

    @property
    def extension(self) -> dict[str, Any]:
        return {
            "episode_id": str(self.episode_id),
            "call_id": str(self.call_id),
            "policy_version": self.policy_version,
        }

    @property
    def headers(self) -> dict[str, str]:
        return {"x-trainyard-policy-version": str(self.policy_version)}


async def record_call(
    pg: asyncpg.Pool,
    claims: Claims,
    *,
    call_id: uuid.UUID,
    episode_id: uuid.UUID,
    token_hash: str,
    claim: Claim,
    seq: int,
    request: dict[str, Any],
    reply: dict[str, Any],
    response: dict[str, Any],
    latency_ms: float,
) -> None:
    """The call's row, if its claim is still the token's; otherwise EpisodeNotOpen (or
    EpisodeNotFound) and nothing recorded."""
    status = await pg.execute(
        _RECORD,
        call_id,
        episode_id,
        claim.run_id,
        claim.issued,
        seq,
        int(reply["policy_version"]),
        jsontext.jsonb(request),  # as the client sent it, NUL and NaN aside
        jsontext.jsonb(response),  # as the policy wrote it, NUL aside
        wire.pack_ids(reply["prompt_ids"]),
        wire.pack_ids(reply["completion_ids"]),
        wire.pack_floats(reply["logprobs"]),
        latency_ms,
        float(reply.get("generation_ms") or 0.0),
        token_hash,
        float(reply.get("queued_ms") or 0.0),
    )
    if status != "INSERT 0 1":
        claims.forget(episode_id, token_hash)
        await why_not(pg, episode_id, token_hash)
        raise EpisodeNotOpen("The episode is not open.")


# Attached to every move of a run to a terminal status (app/runs/lifecycle/state.py), in its
# statement: the run's episodes still open end with it, ``dropped``, saying why; a harness
# holding one gets a 409 at its next call or finish, as before. $1: the run's new status.
ENDED_WITH_RUN = """
    UPDATE episodes AS e
       SET status = 'dropped', token_hash = NULL, ended_at = now(),
           error = 'The run ended (' || $1 || ') before the episode did.'
      FROM moved
     WHERE e.run_id = moved.id AND e.status IN ('pending', 'claimed')
"""


# -- reading ---------------------------------------------------------------------------------

_EPISODE_COLUMNS = """e.id, e.run_id, e.phase, e.step, e.group_index, e.rollout_index,
    e.task_input_id, e.status, e.attempt, e.issued, e.reward, e.metrics, e.error,
    e.deadline, e.created_at, e.ended_at,
    (SELECT count(*) FROM episode_calls c WHERE c.episode_id = e.id AND c.issue = e.issued)
        AS calls"""


def _decoded(row: asyncpg.Record) -> dict[str, Any]:
    out = dict(row)
    for key in ("metrics", "prompt", "context", "messages", "request", "response"):
        if isinstance(out.get(key), str):
            out[key] = jsontext.loads(out[key])
    return out


async def list_episodes(
    pg: asyncpg.Pool,
    run_id: uuid.UUID,
    *,
    step: int | None,
    status: str | None,
    after: tuple[datetime, uuid.UUID] | None,
    limit: int,
) -> list[dict[str, Any]]:
    """The run's episodes in keyset order (created_at, id), after the cursor's position."""
    rows = await pg.fetch(
        f"""SELECT {_EPISODE_COLUMNS} FROM episodes e
             WHERE e.run_id = $1 AND ($2::int IS NULL OR e.step = $2)
               AND ($3::text IS NULL OR e.status = $3)
               AND ($4::timestamptz IS NULL OR (e.created_at, e.id) > ($4, $5::uuid))
             ORDER BY e.created_at, e.id LIMIT $6""",
        run_id,
        step,
        status,
        after[0] if after else None,
        after[1] if after else None,
        limit,
    )
    return [_decoded(r) for r in rows]


async def episode_detail(
    pg: asyncpg.Pool, episode_id: uuid.UUID, project_id: uuid.UUID, *, with_tokens: bool
) -> dict[str, Any]:
    row = await pg.fetchrow(
        f"""SELECT {_EPISODE_COLUMNS}, e.prompt, e.context, e.messages
              FROM episodes e JOIN runs r ON r.id = e.run_id
             WHERE e.id = $1 AND r.project_id = $2""",
        episode_id,
        project_id,
    )
    if row is None:
        raise EpisodeNotFound()
    calls = await pg.fetch(
        """SELECT id, issue, seq, policy_version, request, response, prompt_ids,
                  completion_ids, logprobs, latency_ms, generation_ms, queued_ms, created_at
             FROM episode_calls WHERE episode_id = $1 ORDER BY issue, seq""",
        episode_id,
    )
    call_log = []
    for call in calls:
        item = _decoded(call)
        prompt_ids = wire.unpack_ids(item.pop("prompt_ids"))
        completion_ids = wire.unpack_ids(item.pop("completion_ids"))
        logprobs = wire.unpack_floats(item.pop("logprobs"))
        item["prompt_tokens"] = len(prompt_ids)
        item["completion_tokens"] = len(completion_ids)
        if with_tokens:
            item |= {
                "prompt_ids": prompt_ids,
                "completion_ids": completion_ids,
                "logprobs": logprobs,
            }
        call_log.append(item)
    return {**_decoded(row), "call_log": call_log}


def json_list(value: Any) -> list[dict[str, Any]]:
    return jsontext.loads(value) if isinstance(value, str) else list(value or [])


def json_object(value: Any) -> dict[str, Any]:
    return jsontext.loads(value) if isinstance(value, str) else dict(value or {})
