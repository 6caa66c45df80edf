"""Push mode: the worker hands each episode to the run's harness itself (``environment.
harness`` of the catalog, or ``harness_url`` under the open code policy) instead of waiting
for a harness to claim it.

Each waiting episode is claimed as a harness would claim it (a token that opens it only),
and POSTed to the harness with what a claim answers (its input, the run's prompt, its OpenAI
base URL under ``TRAINYARD_PUBLIC_URL``, its token, its deadline). The harness plays it
through the API like any harness and answers the POST with the finish's body (``reward``,
``metrics``, ``messages``), or ``{"error": ...}`` to fail it. An answer that is not one of
those, a harness that does not answer, or one that answers after the deadline leaves the
episode to its deadline: it is handed out (pushed) again, up to ``max_issues``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from typing import Any

import httpx
from pydantic import ValidationError

from app.gateway import service, tokens, wire
from app.gateway.models import EpisodeStatus
from app.gateway.schemas import FailBody, FinishBody
from workers.context import RunContext

log = logging.getLogger(__name__)


class PushUnavailable(ValueError):
    """Push mode cannot work on this worker (no public URL for the harness to call back)."""


class Pusher:
    def __init__(
        self, ctx: RunContext, run_id: str, url: str, timeout: float, concurrency: int, wake: Any
    ) -> None:
        public = ctx.settings.public_url
        if not public:
            raise PushUnavailable(
                "a push-mode gateway run needs TRAINYARD_PUBLIC_URL on the workers: the API's "
                "base URL as the harness reaches it, for each episode's OpenAI base URL"
            )
        self.ctx = ctx
        self.run_id = run_id
        self.url = url
        self.public = public.rstrip("/")
        self.timeout = timeout
        self.wake = wake  # called when an episode ended, so the step stops waiting for it
        self.http = httpx.Client(timeout=timeout)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="gateway-push"
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def push_waiting(self, n: int) -> int:
        """Claim up to ``n`` waiting episodes and push each to the harness; how many."""

        async def claim() -> list[Any]:
            async with self.ctx.runtime.pg() as conn:
                return await service.claim(conn, self.run_id, n)  # type: ignore[arg-type]

        claimed = self.ctx.runtime.run(claim())
        for row, token in claimed:
            self.pool.submit(self._push, row, token)
        return len(claimed)

    def _push(self, row: Any, token: str) -> None:
        prompt = service.json_list(row["prompt"])
        body = {
            "id": str(row["id"]),
            "run_id": self.run_id,
            "phase": row["phase"],
            "step": row["step"],
            "group_index": row["group_index"],
            "rollout_index": row["rollout_index"],
            "issue": row["issued"],
            "input": {
                "id": None if row["task_input_id"] is None else str(row["task_input_id"]),
                "text": str(prompt[-1].get("content", "")) if prompt else "",
                "context": service.json_object(row["context"]),
            },
            "messages": prompt,
            "base_url": f"{self.public}/gateway/episodes/{row['id']}/v1",
            "token": token,
            "deadline": row["deadline"].isoformat(),
        }
        try:
            answer = self.http.post(self.url, json=body)
            answer.raise_for_status()
            outcome = answer.json()
            if isinstance(outcome, dict) and "error" in outcome:
                failed = FailBody.model_validate({"error": str(outcome["error"])[:4000] or "?"})
                self._end(row, token, EpisodeStatus.failed, error=failed.error)
            else:
                finished = FinishBody.model_validate(outcome)
                self._end(
                    row,
                    token,
                    EpisodeStatus.finished,
                    reward=finished.reward,
                    metrics=finished.metrics,
                    messages=finished.messages,
                )
        except (httpx.HTTPError, json.JSONDecodeError, ValidationError) as exc:
            log.warning(
                "run %s: the harness did not finish episode %s (%s); it is handed out again "
                "at its deadline",
                self.run_id,
                row["id"],
                str(exc)[:300],
            )
        except service.EpisodeNotOpen as exc:
            log.info("run %s: episode %s: %s", self.run_id, row["id"], exc)

    def _end(self, row: Any, token: str, status: EpisodeStatus, **outcome: Any) -> None:
        parsed = tokens.parse(token)
        assert parsed is not None

        async def end() -> int:
            async with self.ctx.runtime.pg() as conn:
                _, issue = await service.end(conn, row["id"], parsed[1], status=status, **outcome)  # type: ignore[arg-type]
            return issue

        issue = self.ctx.runtime.run(end())
        self.wake(wire.dumps({"kind": "ended", "episode_id": str(row["id"]), "issue": issue}))
