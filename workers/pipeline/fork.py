"""A fork's starting weights: the parent run's checkpoint at the step the run names.

A full fine-tune's checkpoint folder is a model (and tokenizer) the trainer loads as it is.
A LoRA checkpoint is an adapter: it is merged into its base model once, into the fork's own
folder, and the fork trains from that (a new adapter if the fork is a LoRA run too). The
checkpoint is looked up when the run starts, so one pruned since the fork was created fails
the run saying so, before any step.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path

from app.checkpoints import service as checkpoints
from app.runs.models import Run
from workers.context import RunContext


class ForkUnavailable(RuntimeError):
    """The parent's checkpoint is gone (pruned or deleted since the fork was created)."""


async def parent_weights(ctx: RunContext, run: Run, root: Path) -> Path:
    assert run.parent_step is not None
    if run.parent_run_id is None:
        raise ForkUnavailable(
            f"the run the fork was made from is gone (deleted), and its checkpoint at step "
            f"{run.parent_step} with it"
        )
    async with ctx.runtime.session() as session:
        found = await checkpoints.at_step(session, run.parent_run_id, run.parent_step)
    if found is None or not await asyncio.to_thread(Path(found.path).is_dir):
        raise ForkUnavailable(
            f"the checkpoint at step {run.parent_step} of run {run.parent_run_id} is gone "
            "(pruned since this fork was created, or its folder removed)"
        )
    source = Path(found.path)
    if not (source / "adapter_config.json").is_file():
        return source
    merged = root / "fork-model"
    if not (merged / "config.json").is_file():
        await asyncio.to_thread(_merge_adapter, source, run.model_name, merged)
    return merged


def _merge_adapter(adapter: Path, base: str, into: Path) -> None:
    """The LoRA adapter merged into its base model (the one the adapter names: the parent's
    model_name, which is the fork's too), written whole or not at all."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    staging = into.with_name(f".{into.name}.tmp-{uuid.uuid4().hex[:8]}")
    model.merge_and_unload().save_pretrained(str(staging))
    tokenizer_home = adapter if (adapter / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tokenizer_home)).save_pretrained(str(staging))
    if into.exists():
        shutil.rmtree(into)
    os.rename(staging, into)
