"""``trainyard runs``: create, list, get, cancel, pause, resume, follow, events and compare
training runs, over HTTP (following a run live is app/cli/follow.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from app.cli.common import CliError, Json, err, print_json, shown, table
from app.cli.http import After, Api, ApiKey, ApiUrl
from app.cli.models import absolute_model_paths

runs_app = typer.Typer(no_args_is_help=True, help="Training runs (over HTTP).")


@runs_app.command("create")
def runs_create(
    preset: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML/JSON run.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides: a.b=value.")
    ] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    as_json: Json = False,
) -> None:
    """Create a run from a preset file (plus overrides); prints the run's id (the run with
    --json). A relative model_name or teacher.student_model is a folder next to the preset or
    in the current folder (an override's: in the current folder), sent as an absolute path."""
    import yaml

    from app.core.config_files import apply_overrides, load_preset

    overrides = overrides or []
    try:
        loaded = load_preset(preset)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise CliError(f"{preset}: {exc}", code=2) from exc
    try:
        body = apply_overrides(loaded, overrides)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from exc
    absolute_model_paths(body, preset, overrides)
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    run = Api(api_url, api_key).call("POST", "/runs", json=body, headers=headers)
    if as_json:
        print_json(run)
        return
    err.print(f"run {run['id']} created ({run['status']}): `trainyard runs get {run['id']}`")
    print(run["id"], flush=True)


@runs_app.command("list")
def runs_list(
    status: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = None,
    limit: Annotated[int, typer.Option(min=1)] = 20,
    after: After = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """List runs, newest first (the whole page with --json)."""
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    if after:
        params["after"] = after
    page = Api(api_url, api_key).call("GET", "/runs", params=params)
    if as_json:
        print_json(page)
        return
    rows = [
        [r["id"], r["status"], str(r["step"]), r["model_name"], r["created_at"]]
        for r in page["data"]
    ]
    print(table(["id", "status", "step", "model", "created"], rows), flush=True)
    if page.get("has_more"):
        err.print(f"[dim]more: --after {page['next_cursor']}", highlight=False)


@runs_app.command("get")
def runs_get(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Print one run (all of it with --json)."""
    run = Api(api_url, api_key).call("GET", f"/runs/{run_id}")
    if as_json:
        print_json(run)
        return
    for name, value in run.items():
        if value is not None and not isinstance(value, dict | list):
            print(f"{name}: {value}")
    if run.get("metrics"):
        print("metrics: " + json.dumps(run["metrics"]))
    err.print("[dim](--json prints the whole run)")


def _action(
    action: str, run_id: str, api_url: str | None, api_key: str | None, as_json: bool
) -> None:
    run = Api(api_url, api_key).call("POST", f"/runs/{run_id}/{action}")
    if as_json:
        print_json(run)
        return
    # A live run's worker applies cancel and pause at its next heartbeat.
    flag = {"cancel": "cancel_requested", "pause": "pause_requested"}.get(action)
    requested = flag is not None and run.get(flag) and run["status"] not in ("cancelled", "paused")
    err.print(f"run {run['id']}: {run['status']}" + (f" ({action} requested)" if requested else ""))


@runs_app.command("cancel")
def runs_cancel(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Cancel a run."""
    _action("cancel", run_id, api_url, api_key, as_json)


@runs_app.command("pause")
def runs_pause(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Pause a run at its next safe point."""
    _action("pause", run_id, api_url, api_key, as_json)


@runs_app.command("resume")
def runs_resume(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Put a paused run back in the queue."""
    _action("resume", run_id, api_url, api_key, as_json)


@runs_app.command("follow")
def runs_follow(
    run_id: str,
    events: Annotated[int, typer.Option(min=0, help="How many of the last events to show.")] = 5,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print each event as one JSON line (NDJSON).")
    ] = False,
) -> None:
    """Follow a run live until it ends: its status, a step bar with the ETA, the reward and
    its curve, and the last events. Resumes by itself after a dropped stream; a finished
    run is shown at once.

    Exit status: 0 completed, 1 failed (the error printed), 2 cancelled, 3 paused
    (`trainyard runs resume` continues it)."""
    from app.cli.follow import EXIT_CODES, follow, until_settled

    api = Api(api_url, api_key)
    run = api.call("GET", f"/runs/{run_id}")
    try:
        with api.problems(), api.client() as client:
            if as_json:
                for event in until_settled(client, str(run["id"]), stop_on_pause=True):
                    if event.type != "keep-alive":
                        print(json.dumps(event.data), flush=True)
                final = api.call("GET", f"/runs/{run['id']}")
            else:
                final = follow(
                    client, run, console=Console(soft_wrap=True), events=events, stop_on_pause=True
                )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    status = final["status"]
    if status == "failed":
        raise CliError(f"run {final['id']} failed: {final.get('error') or '(no error recorded)'}")
    if not as_json:
        said = f"run {final['id']} {status} at step {final['step']}"
        if status == "paused":
            said += f": `trainyard runs resume {final['id']}` continues it"
        print(said, flush=True)
    raise typer.Exit(EXIT_CODES.get(status, 1))


@runs_app.command("events")
def runs_events(
    run_id: str,
    limit: Annotated[int, typer.Option(min=1)] = 50,
    after: After = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """A page of the run's events, oldest first (the whole page with --json)."""
    from app.cli.follow import event_line

    params: dict[str, Any] = {"limit": limit}
    if after:
        params["after"] = after
    page = Api(api_url, api_key).call("GET", f"/runs/{run_id}/events", params=params)
    if as_json:
        print_json(page)
        return
    for event in page["data"]:
        print(f"{event['id']:>6}  {event_line(event)}")
    sys.stdout.flush()
    if page.get("has_more"):
        err.print(f"[dim]more: --after {page['next_cursor']}", highlight=False)


# Fields of a run that are its result or bookkeeping, not how it was asked for.
_NOT_CONFIG = frozenset(
    {
        "id",
        "project_id",
        "status",
        "metrics",
        "error",
        "step",
        "epoch",
        "attempt",
        "failures",
        "cancel_requested",
        "pause_requested",
        "version",
        "created_at",
        "updated_at",
        "started_at",
        "completed_at",
    }
)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A run's settings as dotted names (``grpo.beta``), so two runs compare field by
    field; lists stay whole."""
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(_flatten(inner, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


@runs_app.command("compare")
def runs_compare(
    run_ids: Annotated[list[str], typer.Argument(help="2 to 5 run ids.")],
    all_fields: Annotated[
        bool, typer.Option("--all", help="Every field, not only those that differ.")
    ] = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """Runs side by side: their settings (fields that differ marked `*`; only those unless
    --all), then status, steps and reward (first step, last step, best)."""
    if not 2 <= len(run_ids) <= 5:
        raise CliError(f"compare takes 2 to 5 runs, not {len(run_ids)}", code=2)
    api = Api(api_url, api_key)
    runs = [api.call("GET", f"/runs/{run_id}") for run_id in run_ids]
    flat = [_flatten({k: v for k, v in r.items() if k not in _NOT_CONFIG}) for r in runs]
    names = sorted(set().union(*flat))
    fields = {name: [f.get(name) for f in flat] for name in names}
    differs = [name for name, values in fields.items() if any(v != values[0] for v in values)]
    rewards = []
    for run in runs:
        series = api.call("GET", f"/runs/{run['id']}/metrics", params={"name": "reward_mean"})
        points = [p["value"] for p in series["series"][0]["points"]] if series["series"] else []
        rewards.append(
            {
                "first": points[0] if points else None,
                "last": points[-1] if points else None,
                "best": max(points) if points else None,
                "steps": len(points),
            }
        )
    if as_json:
        print_json(
            {
                "runs": [
                    {"id": r["id"], "status": r["status"], "step": r["step"], "reward": w}
                    for r, w in zip(runs, rewards, strict=True)
                ],
                "fields": fields,
                "differs": differs,
            }
        )
        return
    listed = names if all_fields else differs
    headers = ["", "field", *(r["id"] for r in runs)]
    rows = [["*" if n in differs else "", n, *(shown(v) for v in fields[n])] for n in listed]

    def reward(key: str) -> list[str]:
        return [f"{w[key]:.3f}" if w[key] is not None else "-" for w in rewards]

    rows += [
        ["", "status", *(r["status"] for r in runs)],
        ["", "step", *(str(r["step"]) for r in runs)],
        ["", "reward first", *reward("first")],
        ["", "reward last", *reward("last")],
        ["", "reward best", *reward("best")],
    ]
    print(table(headers, rows), flush=True)
    if not differs:
        err.print("[dim]the runs' settings are the same", highlight=False)
