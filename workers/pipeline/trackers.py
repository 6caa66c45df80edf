"""Experiment trackers a run reports to (``grpo.report_to``: TensorBoard, W&B), attached to
each training stage as transformers' own callbacks (docs/trackers.md)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.runs.spec.parsed import RunSpec


class TrackerUnavailable(RuntimeError):
    pass


def check_trackers(report_to: Sequence[str]) -> None:
    """Fail before any step if a tracker the run reports to cannot work on this worker: its
    package is missing, or W&B would need a login (a worker has no terminal to prompt on:
    give it WANDB_API_KEY, a netrc entry, or WANDB_MODE=offline)."""
    import importlib.util

    packages = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for name in report_to:
        if importlib.util.find_spec(packages[name]) is None:
            raise TrackerUnavailable(
                f"report_to names {name!r} but the {packages[name]!r} package is not installed "
                "on this worker (pip install 'trainyard[worker]')"
            )
    if "wandb" in report_to and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import netrc
        from urllib.parse import urlparse

        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
        try:
            stored = netrc.netrc().authenticators(host or "") is not None
        except (OSError, netrc.NetrcParseError):
            stored = False
        if not (os.environ.get("WANDB_API_KEY") or stored):
            raise TrackerUnavailable(
                f"report_to names 'wandb' but this worker has no W&B API key for {host} "
                "(WANDB_API_KEY or ~/.netrc) and WANDB_MODE is not offline: it would wait "
                "for a login no one can type"
            )


def tracker_callbacks(spec: RunSpec, root: Path, stage: str) -> list[Any]:
    """transformers' own tracker callbacks for one stage of the run (``grpo`` or ``sft``),
    given their folders, names and project explicitly.

    Not through ``report_to``: transformers 5.19 takes TensorBoard's folder, W&B's project
    and folder only from process-wide environment variables (racy in a threads worker) and
    never finishes the W&B run, so the next stage or run in this process would log into it.
    Folders: ``<run>/tensorboard/<stage>``; ``<run>/wandb`` (one W&B run per stage)."""
    report_to = spec.grpo.report_to
    callbacks: list[Any] = []
    if "tensorboard" in report_to:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        callbacks.append(TensorBoardCallback(SummaryWriter(str(root / "tensorboard" / stage))))
    if "wandb" in report_to:
        from workers.pipeline.hooks import StageWandb

        project = spec.grpo.tracker_project or spec.learning_key or "trainyard"
        folder = root / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        callbacks.append(
            StageWandb(
                project=re.sub(r"[^A-Za-z0-9_.-]+", "_", project)[:128],
                name=spec.name + ("-sft" if stage == "sft" else ""),
                run_id=str(spec.id),
                stage=stage,
                folder=folder,
            )
        )
    return callbacks
