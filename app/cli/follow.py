"""Following a run live over its Server-Sent Events stream: the one implementation behind
`trainyard runs follow` and `trainyard demo`.

:func:`stream_events` is the protocol: every event of ``GET /runs/{id}/events/stream`` once
and in order, reconnecting with ``Last-Event-ID`` after a dropped connection (an API
restart, a proxy timeout), until the stream's ``end``; app/events/sse.py parses it (and
frames it, on the API's side). :func:`follow` draws it: the status, a step bar with its
ETA, the latest reward beside a sparkline of the curve so far, and the last few events, one
line each. The ETA is worked out from the events' own timestamps, not from how fast they
arrive, so that a follow that starts late (the stream replays what it missed) shows the
run's pace rather than the replay's.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from typing import Any

import httpx
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from app.events import sse

SPARK = "▁▂▃▄▅▆▇█"
# What `trainyard runs follow` exits with once the run is there (docs/cli.md).
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 2, "paused": 3}


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0) -> str:
    span = (hi - lo) or 1.0
    return "".join(
        SPARK[min(len(SPARK) - 1, max(0, int((v - lo) / span * len(SPARK))))] for v in values
    )


def buckets(values: list[float], width: int) -> list[float]:
    """``values`` averaged down to at most ``width`` points, for a sparkline that fits."""
    if len(values) <= width:
        return values
    edges = [round(i * len(values) / width) for i in range(width + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in pairwise(edges) if b > a]


def curve(values: list[float], width: int = 40) -> str:
    """A sparkline of a reward curve on its own scale (rewards need not lie in [0, 1])."""
    if not values:
        return ""
    shown = buckets(values, width)
    return sparkline(shown, min(0.0, *shown), max(1.0, *shown))


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a run's stream: a run event (``data`` as
    ``RunEventPublic``), a ``keep-alive`` (nothing happened for a while), or the ``end``
    (``data``: the run's final status)."""

    id: str | None
    type: str
    data: dict[str, Any]


def stream_events(
    client: httpx.Client, run_id: str, *, retry_seconds: float = sse.RETRY_MS / 1000
) -> Iterator[Event]:
    """Every event of the run's stream, each once, then its ``end``. A dropped connection or
    a 5xx answer is retried from the last event seen (``Last-Event-ID``) after the delay the
    stream's ``retry:`` asked for (``retry_seconds`` until one did); any other error answer
    raises :class:`httpx.HTTPStatusError` (its body read)."""
    last_id: str | None = None
    while True:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        try:
            with client.stream(
                "GET", f"/runs/{run_id}/events/stream", headers=headers, timeout=None
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    if response.status_code < 500:
                        response.raise_for_status()
                else:
                    parser = sse.Parser()
                    for chunk in response.iter_bytes():
                        for message in parser.feed(chunk):
                            if message.retry is not None:
                                retry_seconds = message.retry / 1000
                            if message.data is None:
                                if message.comment is not None:
                                    yield Event(None, "keep-alive", {})
                                continue
                            data = json.loads(message.data)
                            if message.event == "end":
                                yield Event(None, "end", data)
                                return
                            last_id = message.id or last_id
                            yield Event(message.id, message.event, data)
        except httpx.TransportError:
            pass  # dropped: resumed below from Last-Event-ID
        time.sleep(retry_seconds)


def event_line(event: dict[str, Any]) -> str:
    """A run event as one line: its time, its type and what it says, e.g.
    ``12:03:41  status  training → completed: completed``."""
    data = event.get("data") or {}
    at = _when(event)
    when = at.strftime("%H:%M:%S") if at else ""
    kind = str(event.get("type") or "")
    said = " ".join(str(event.get("message") or "").split())
    if kind == "status":
        moved = f"{data['from']} → {data.get('to')}" if data.get("from") else f"→ {data.get('to')}"
        said = f"{moved}: {said}" if said and said != moved else moved
        if data.get("error"):
            said += f" ({' '.join(str(data['error']).split())})"
    elif kind == "step" and not said:
        said = f"step {data.get('step')}"
    return f"{when}  {kind:<7}  {said}"


class Narrator:
    """What is said beside the bar as events arrive. The plain view says nothing more than
    the bar; the agent demo's narrator tells the warm-up and the episodes."""

    def event(self, progress: Progress, task: TaskID, event: str, data: dict[str, Any]) -> None:
        return None

    def idle(self, progress: Progress, task: TaskID) -> None:
        """A keep-alive of the stream: nothing happened for a while."""
        return None


class RunView(Progress):
    """The bar (status, steps, ETA, elapsed, the narrator's note), then the reward line and
    the last events."""

    def __init__(self, console: Console, events: int) -> None:
        # Set first: Progress draws (get_renderables) from its constructor on.
        self.rewards: list[float] = []
        self.recent: deque[str] = deque(maxlen=events)
        super().__init__(
            TextColumn("[bold]{task.fields[status]:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[eta]}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=console,
        )

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        if self.rewards:
            yield Text(f"    reward {self.rewards[-1]:.3f}  {curve(self.rewards)}", no_wrap=True)
        for line in self.recent:
            yield Text(f"    {line}", no_wrap=True, overflow="ellipsis", style="dim")


@dataclass
class _Pace:
    """When GRPO steps started and when the last one ended, from the events' timestamps."""

    started: datetime | None = None
    last: datetime | None = None
    step: int = 0

    def eta(self, total: int) -> str:
        if not (self.started and self.last and self.step and total > self.step):
            return ""
        per_step = (self.last - self.started).total_seconds() / self.step
        left = int(per_step * (total - self.step))
        return f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"


def _when(event: dict[str, Any]) -> datetime | None:
    try:
        return datetime.fromisoformat(str(event.get("created_at")))
    except ValueError:
        return None


def metric_series(client: httpx.Client, run_id: str, name: str) -> list[float]:
    """One metric's values, by step."""
    found = (
        client.get(f"/runs/{run_id}/metrics", params={"name": name})
        .raise_for_status()
        .json()["series"]
    )
    return [p["value"] for p in found[0]["points"]] if found else []


def until_settled(
    client: httpx.Client, run_id: str, *, stop_on_pause: bool = False
) -> Iterator[Event]:
    """The run's events (keep-alives included) until its stream ends, or, with
    ``stop_on_pause``, until the run is paused: a paused run goes on only when a person
    resumes it. A pause in the run's past (replayed, resumed since) does not stop it."""
    for event in stream_events(client, run_id):
        if event.type == "end":
            return
        yield event
        moved = event.data.get("data") or {}
        if stop_on_pause and event.type == "status" and moved.get("to") == "paused":
            now = client.get(f"/runs/{run_id}").raise_for_status().json()
            if now["status"] == "paused":
                return


def follow(
    client: httpx.Client,
    run: dict[str, Any],
    narrator: Narrator | None = None,
    *,
    console: Console,
    events: int = 0,
    stop_on_pause: bool = False,
) -> dict[str, Any]:
    """Follow the run's stream until its end (or, with ``stop_on_pause``, until it is
    paused), drawing it on ``console`` with the last ``events`` events; returns the run as
    it is then. A finished run's stream replays its events and ends at once."""
    narrator = narrator or Narrator()
    run_id = str(run["id"])
    total = run.get("max_steps") or 0
    pace = _Pace()
    with RunView(console, events) as view:
        task = view.add_task("run", total=total or None, status=run["status"], note="", eta="")
        for event in until_settled(client, run_id, stop_on_pause=stop_on_pause):
            if event.type == "keep-alive":
                narrator.idle(view, task)
                continue
            body = event.data
            data = body.get("data") or {}
            view.recent.append(event_line(body))
            if event.type == "status":
                to = data.get("to")
                view.update(task, status=to)
                if to == "collecting" and pace.started is None:
                    pace.started = _when(body)
            elif event.type == "step":
                pace.step, pace.last = int(data["step"]), _when(body)
                if data.get("reward_mean") is not None:
                    view.rewards.append(float(data["reward_mean"]))
                view.update(task, completed=pace.step, eta=pace.eta(total))
            narrator.event(view, task, event.type, body)
        final: dict[str, Any] = client.get(f"/runs/{run_id}").raise_for_status().json()
        # The stored curve is the whole truth (a pipeline may record steps without events).
        view.rewards = metric_series(client, run_id, "reward_mean") or view.rewards
        view.update(task, status=final["status"], completed=final["step"], eta="")
    return final
