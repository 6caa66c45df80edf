"""A whole run driven by the Python client openapi-python-client generated from /openapi.json
(the package ``trainyard_client``, on ``PYTHONPATH``), as a user's script would drive it.

    python python_drive.py BASE_URL API_KEY MODEL

It runs in the generator's virtualenv (.venv-clients), not the service's: only the generated
package and what it imports (httpx, attrs, python-dateutil). It creates a run, polls it until
it completes (with If-None-Match), reads its trajectories, metrics, event stream and export,
then creates a second run and cancels it, and prints what it saw as one JSON object. The
types it checks on the way are the document's: each answer is parsed into the generated
models, and a model missing (or an answer parsed as the wrong one) fails here.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from trainyard_client import AuthenticatedClient
from trainyard_client.api.events import stream_run_events
from trainyard_client.api.metrics import get_run_metrics
from trainyard_client.api.runs import cancel_run, create_run, get_run
from trainyard_client.api.training_data import export_trajectories
from trainyard_client.api.trajectories import list_run_trajectories
from trainyard_client.models import (
    FunctionRewardInput,
    FunctionRewardOutput,
    GrpoSettingsInput,
    GrpoSettingsOutput,
    InputItem,
    InputItemSplit,
    ProblemDetail,
    RewardFunctionInput,
    RewardFunctionInputArgs,
    RunCreate,
    RunMetrics,
    RunPublic,
    RunStatus,
    TrajectoriesPage,
    TrajectoryMessageOutput,
)
from trainyard_client.types import Response

TERMINAL = {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED}


def parsed(what: str, response: Response[Any], kind: type) -> Any:
    if not isinstance(response.parsed, kind):
        raise SystemExit(f"{what}: {response.status_code} {response.content[:500]!r}")
    return response.parsed


def run_body(model: str, max_steps: int) -> RunCreate:
    args = RewardFunctionInputArgs.from_dict({"char": "a"})
    return RunCreate(
        model_name=model,
        task_description="Answer with as many letters a as you can.",
        rollouts_per_group=4,
        learning_rate=5e-3,
        max_steps=max_steps,
        inputs=[
            InputItem(input_text="Say something."),
            InputItem(input_text="Sing.", split=InputItemSplit.TRAIN),
        ],
        reward=FunctionRewardInput(
            type_="function", functions=[RewardFunctionInput(name="char_fraction", args=args)]
        ),
        grpo=GrpoSettingsInput(groups_per_step=2, max_completion_length=8, beta=0, warmup_ratio=0),
    )


def poll(
    client: AuthenticatedClient, run_id: uuid.UUID, done: Callable[[RunPublic], bool]
) -> RunPublic:
    etag: str | None = None
    last: RunPublic | None = None
    deadline = time.monotonic() + 600  # only turns a hang into a failure
    while True:
        kwargs = {"if_none_match": etag} if etag else {}
        response = get_run.sync_detailed(run_id, client=client, **kwargs)
        if response.status_code != HTTPStatus.NOT_MODIFIED:
            last = parsed("get_run", response, RunPublic)
            etag = response.headers.get("ETag")
            if done(last):
                return last
        if time.monotonic() > deadline:
            raise SystemExit(f"run {run_id} never got there: {last and last.status}")
        time.sleep(0.25)


def main(base: str, key: str, model: str) -> None:
    client = AuthenticatedClient(base_url=base, token=key, timeout=60)
    key_once = f"py-{uuid.uuid4()}"
    body = run_body(model, 2)
    first = create_run.sync_detailed(client=client, body=body, idempotency_key=key_once)
    created = parsed("create_run", first, RunPublic)
    replay = create_run.sync_detailed(client=client, body=body, idempotency_key=key_once)
    replayed = parsed("create_run (replay)", replay, RunPublic)
    finished = poll(client, created.id, lambda r: r.status in TERMINAL)

    page = parsed(
        "list_run_trajectories",
        list_run_trajectories.sync_detailed(created.id, client=client, limit=100),
        TrajectoriesPage,
    )
    roles = sorted(
        {
            message.role.value
            for trajectory in page.data
            for message in trajectory.messages or []
            if isinstance(message, TrajectoryMessageOutput)
        }
    )
    metrics = parsed(
        "get_run_metrics", get_run_metrics.sync_detailed(created.id, client=client), RunMetrics
    )
    # The stream is text: the client hands it over as such, for an SSE parser to split.
    stream = stream_run_events.sync_detailed(created.id, client=client)
    text = parsed("stream_run_events", stream, str)
    streamed = [
        line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")
    ]
    # JSON Lines: openapi-python-client reads only JSON, text/* and octet-stream answers, so
    # it hands this one over as the raw response.
    exported = export_trajectories.sync_detailed(client=client, run_id=[created.id])
    if exported.status_code != HTTPStatus.OK:
        raise SystemExit(f"export_trajectories: {exported.status_code} {exported.content[:500]!r}")
    lines = [json.loads(line) for line in exported.content.decode().splitlines() if line]

    second = parsed(
        "create_run",
        create_run.sync_detailed(client=client, body=run_body(model, 1000)),
        RunPublic,
    )
    cancel = parsed("cancel_run", cancel_run.sync_detailed(second.id, client=client), RunPublic)
    cancelled = poll(client, second.id, lambda r: r.status == RunStatus.CANCELLED)

    print(
        json.dumps(
            {
                "created": {
                    "id": str(created.id),
                    "status": created.status.value,
                    "etag": first.headers.get("ETag"),
                },
                "replayed": replay.headers.get("Idempotent-Replayed"),
                "replayed_id": str(replayed.id),
                "finished": {
                    "status": finished.status.value,
                    "step": finished.step,
                    "error": finished.error,
                },
                # The answer's settings are the request's models, answer side.
                "typed": {
                    "grpo": isinstance(finished.grpo, GrpoSettingsOutput),
                    "reward": isinstance(finished.reward, FunctionRewardOutput),
                    "beta": finished.grpo.beta,
                },
                "problem_model": ProblemDetail.__name__,
                "trajectories": len(page.data),
                "roles": roles,
                "rewards": [t.reward for t in page.data],
                "metrics": [series.name for series in metrics.series],
                "streamed": streamed,
                "exported": len(lines),
                "exported_run": lines[0]["run_id"] if lines else None,
                "cancel_answer": [cancel.status.value, cancel.cancel_requested],
                "cancelled": cancelled.status.value,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
