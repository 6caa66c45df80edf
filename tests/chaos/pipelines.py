"""The real training pipeline with one fault injected, for the chaos tier. Selected with
``TRAINYARD_PIPELINE=tests.chaos.pipelines:dies_mid_checkpoint``."""

from __future__ import annotations

import asyncio
import importlib
import os
from typing import Any

from workers.context import RunContext
from workers.pipeline import run_pipeline


async def dies_mid_checkpoint(ctx: RunContext) -> None:
    """On the run's first attempt, the worker process dies while writing the checkpoint at
    ``config.die_at_checkpoint``: after the model weights, before the optimizer state."""
    # Imported off the event loop: a multi-second import there would starve the heartbeat.
    transformers = await asyncio.to_thread(importlib.import_module, "transformers")
    Trainer = transformers.Trainer

    run = await ctx.load()
    at = run.config.get("die_at_checkpoint")
    original = Trainer._save_optimizer_and_scheduler

    def save(self: Any, output_dir: str) -> None:
        if ctx.fence.attempt == 1 and self.state.global_step == at:
            os._exit(17)
        original(self, output_dir)

    Trainer._save_optimizer_and_scheduler = save  # type: ignore[method-assign]
    try:
        await run_pipeline(ctx)
    finally:
        Trainer._save_optimizer_and_scheduler = original  # type: ignore[method-assign]
