"""The optional SFT warm-up of a run, before its first GRPO step: TRL's ``SFTTrainer`` on
chat demonstrations (tool calls included), the loss on assistant turns only.

A tiny or base model rarely calls a tool on its own, and GRPO cannot reinforce what it never
samples: a few demonstrations first teach the format. The examples come inline
(``sft.examples``) or from earlier runs' trajectories through the training-data library
(``sft.query``, always within the run's project). In a run with an environment each example
is rendered with the environment's tool schemas, exactly as GRPO's prompts will be.

The run is ``warming_up`` meanwhile; the loss curve is stored as metrics ``sft/*`` by SFT
step. The warm-up checkpoints every epoch (and when paused), so a crash resumes it from
its last checkpoint; its model, once saved under ``<run>/sft/model``, is where GRPO starts,
and a run that crashes later never redoes it.

Examples are tokenized here with TRL's training chat template (``{% generation %}``
markers) rather than handed over as messages: an Arrow column of tool calls would unify
every call's arguments into one struct, rendering ``{"a": 3, "b": 4, "key": null}``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from app.runs.spec.parsed import RunSpec
from app.training_data.library import get_training_trajectories_async
from workers.context import RunContext

log = logging.getLogger(__name__)


class SftUnavailable(ValueError):
    """The warm-up has nothing to train on, or its examples cannot be used."""


def model_dir(root: Path) -> Path:
    return root / "sft" / "model"


def done(root: Path) -> bool:
    return (model_dir(root) / "config.json").is_file()


async def examples(ctx: RunContext, spec: RunSpec) -> list[list[dict[str, Any]]]:
    """The demonstrations: inline, or the trajectories the query selects in the run's
    project (each one's whole conversation)."""
    assert spec.sft is not None
    if spec.sft.examples:
        return [e.model_dump()["messages"] for e in spec.sft.examples]
    query = spec.sft.query
    assert query is not None  # the API checked: examples or a query
    async with ctx.runtime.pg() as conn:
        found = await get_training_trajectories_async(
            conn,
            projects=[str(spec.project_id)],
            learning_key=query.learning_key,
            run_ids=[str(r) for r in query.run_ids] if query.run_ids else None,
            min_reward=query.min_reward,
            limit=query.limit,
            include_metadata=False,
        )
    chats = [
        t.messages
        for t in found
        if t.messages and any(m.get("role") == "assistant" for m in t.messages)
    ]
    if not chats:
        raise SftUnavailable(
            "the sft query selects no trajectory with an assistant message in this project "
            f"({query.model_dump_json(exclude_none=True)})"
        )
    return chats


def tool_schemas(factory: type | None) -> list[dict[str, Any]] | None:
    """The environment's tools as the chat template gets them in GRPO (transformers'
    get_json_schema of each tool method), so demonstrations and rollouts see one prompt."""
    if factory is None:
        return None
    import inspect

    from transformers.utils import get_json_schema

    return [
        get_json_schema(method)
        for name, method in inspect.getmembers(factory, predicate=inspect.isfunction)
        if not name.startswith("_") and name != "reset"
    ]


def _tokenize(
    tokenizer: Any, chats: list[list[dict[str, Any]]], tools: list[dict[str, Any]] | None
) -> list[dict[str, list[int]]]:
    from trl.chat_template_utils import get_training_chat_template

    template = get_training_chat_template(tokenizer)
    rows = []
    for n, chat in enumerate(chats):
        messages = [_plain(m) for m in chat]
        out = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        mask = list(out["assistant_masks"])
        if 1 not in mask:
            raise SftUnavailable(
                f"sft example {n}: no assistant token to train on (the model's chat template "
                "marks no assistant turn)"
            )
        rows.append({"input_ids": list(out["input_ids"]), "assistant_masks": mask})
    return rows


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A stored message as the chat template reads it: what the model saw, nothing of the
    bookkeeping (durations, errors, ids) and never a missing content."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments")),
                },
            }
            for c in message["tool_calls"]
        ]
    if message["role"] == "tool" and message.get("name"):
        out["name"] = message["name"]
    return out


def _arguments(value: Any) -> Any:
    if isinstance(value, str):  # OpenAI's form: a JSON string
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value or {}


def warm_up(
    ctx: RunContext,
    spec: RunSpec,
    root: Path,
    chats: list[list[dict[str, Any]]],
    factory: type | None,
) -> Path:
    """Run the warm-up (blocking) and return the folder of its model."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from app.gateway.samples import canonical_tools
    from workers.pipeline.hooks import SftCallback
    from workers.pipeline.trackers import tracker_callbacks

    sft, grpo = spec.sft, spec.grpo
    assert sft is not None
    staging = root / "sft" / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_name)
    environment = spec.environment
    tools = (
        canonical_tools(environment.tools)  # a gateway run's: the tools its harness offers
        if environment is not None and environment.type == "gateway"
        else tool_schemas(factory)
    )
    dataset = Dataset.from_list(_tokenize(tokenizer, chats, tools))
    cuda = torch.cuda.is_available()
    config = SFTConfig(
        output_dir=str(staging),
        num_train_epochs=sft.epochs,
        learning_rate=sft.learning_rate,
        per_device_train_batch_size=sft.batch_size,
        max_length=sft.max_seq_length,
        packing=sft.packing,
        seed=grpo.seed,
        logging_steps=1,
        save_strategy="epoch",
        save_total_limit=2,
        report_to=[],  # trackers are attached as callbacks: tracker_callbacks
        run_name=f"{spec.name}-sft",
        disable_tqdm=True,
        bf16=grpo.bf16 and cuda,
        fp16=grpo.fp16 and cuda,
        gradient_checkpointing=grpo.gradient_checkpointing,
        use_cpu=not cuda,
    )
    trainer = SFTTrainer(
        model=spec.model_name,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[SftCallback(ctx), *tracker_callbacks(spec, root, "sft")],
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    resume = last_complete_checkpoint(staging)
    if resume:
        ctx.runtime.run(ctx.event("sft", f"SFT warm-up resumes from {Path(resume).name}"))
    trainer.train(resume_from_checkpoint=resume)

    final = model_dir(root)
    temporary = final.with_name(f".model.tmp-{uuid.uuid4().hex[:8]}")
    trainer.save_model(str(temporary))
    tokenizer.save_pretrained(str(temporary))  # the original chat template, for GRPO
    if final.exists():
        shutil.rmtree(final)
    os.rename(temporary, final)
    shutil.rmtree(staging, ignore_errors=True)
    return final


def last_complete_checkpoint(staging: Path) -> str | None:
    """The newest warm-up checkpoint that was written to the end, or None.

    A worker killed while the trainer saved leaves a folder without its trainer state, the
    last file the trainer writes (transformers' own get_last_checkpoint would pick it and
    the resume would fail on it): such folders are removed and the one before is taken."""
    numbered = [
        path
        for path in staging.glob("checkpoint-*")
        if path.is_dir() and path.name.removeprefix("checkpoint-").isdigit()
    ]
    for path in sorted(
        numbered, key=lambda p: int(p.name.removeprefix("checkpoint-")), reverse=True
    ):
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (OSError, ValueError):
            log.warning("removing the half-written warm-up checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)
            continue
        return str(path)
    return None
