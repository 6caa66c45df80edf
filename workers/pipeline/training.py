"""GRPO training with TRL: TRL's ``GRPOTrainer`` does every update; Trainyard hooks in
through TRL's extension points only, so the run's status is true to what happens:

- ``collecting``: set when a step begins; TRL generates the rollouts;
- the reward function is Trainyard's :class:`~workers.pipeline.steps.StepBridge`: it stores
  every rollout and moves the run to ``scoring`` in one transaction, scores the groups,
  stores the rewards and moves the run to ``training`` in another, then hands TRL the
  rewards;
- ``training``: TRL computes the loss and steps the optimizer;
  :class:`~workers.pipeline.callback.RunCallback` stores
  the step's metrics, promotes checkpoints (staging folder → rename → record) and honours
  cancel and pause requests.

Runs in a worker thread; database work is handed to the runtime's event loop, fenced on
the run's lease. Step numbers start at 1 (the checkpoint after step N is checkpoint-N).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from app.runs.lifecycle.state import transition
from app.runs.lifecycle.status import RunStatus
from app.runs.models import Run
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.environments import LoadedEnvironment
from workers.pipeline.disk import raise_if_disk_full
from workers.pipeline.paths import RunPaths
from workers.pipeline.plan import InputBatch, PlannedInput, dataset_rows
from workers.pipeline.steps import StepBridge
from workers.pipeline.world import Ranks
from workers.rewards import Scorer

log = logging.getLogger(__name__)
S = RunStatus


class ModelUnavailable(RuntimeError):
    pass


def check_model(model_name: str, *, tools: bool = False, sft: bool = False) -> None:
    """Fail before any step if the model or its tokenizer cannot be loaded here (with
    ``tools``: or if TRL cannot run tool calls with its chat template; with ``sft``: or if
    TRL cannot mark its assistant turns for the warm-up's loss)."""
    from transformers import AutoConfig, AutoTokenizer

    where = "folder" if os.path.isdir(model_name) else "hub id"
    if where == "hub id" and (model_name.startswith((".", "/", "~")) or model_name.count("/") > 1):
        # A path, not a hub id: say so now, not after the hub client's retries.
        raise ModelUnavailable(
            f"model_name {model_name!r} cannot be loaded: it is not a folder on this worker "
            f"(working directory {os.getcwd()}); give the absolute path of a folder every "
            "worker can read"
        )
    try:
        AutoConfig.from_pretrained(model_name)
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    except Exception as exc:
        raise ModelUnavailable(
            f"model_name {model_name!r} ({where}) cannot be loaded on this worker: "
            f"{type(exc).__name__}: {str(exc)[:500]}"
        ) from exc
    if not getattr(tokenizer, "chat_template", None):
        raise ModelUnavailable(f"the tokenizer of {model_name!r} has no chat template")
    if tools:
        from trl.chat_template_utils import add_response_schema, supports_tool_calling

        if not supports_tool_calling(tokenizer):
            raise ModelUnavailable(
                f"the chat template of {model_name!r} cannot render tool calls and results, "
                "so it cannot run an environment"
            )
        if getattr(tokenizer, "response_template", None) is None:
            try:
                add_response_schema(tokenizer)
            except ValueError as exc:
                raise ModelUnavailable(
                    f"TRL cannot parse the tool calls of {model_name!r}: {exc}"
                ) from exc
    if sft:
        from trl.chat_template_utils import get_training_chat_template

        try:
            get_training_chat_template(tokenizer)
        except ValueError as exc:
            raise ModelUnavailable(
                f"the chat template of {model_name!r} cannot be trained with an SFT warm-up "
                f"(the loss is on assistant turns only): {exc}"
            ) from exc


def grpo_config(
    spec: RunSpec, paths: RunPaths, n_steps: int, *, evaluate: bool, max_turns: int | None = None
) -> Any:
    """TRL's GRPOConfig of the run: its settings' one mapping (GrpoSettings.trl_arguments)."""
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        **spec.grpo.trl_arguments(
            output_dir=str(paths.staging),
            num_generations=spec.rollouts_per_group,
            learning_rate=spec.learning_rate,
            max_steps=n_steps,
            run_name=spec.name,
            cuda=torch.cuda.is_available(),
            evaluate=evaluate,
            max_turns=max_turns,
        )
    )


def train(
    ctx: RunContext,
    spec: RunSpec,
    plan: list[InputBatch],
    validation: list[PlannedInput],
    scorer: Scorer,
    paths: RunPaths,
    resume_from: Path | None,
    environment: LoadedEnvironment | None = None,
    model: str | None = None,
) -> Path:
    """Run TRL's GRPO over the plan (blocking); returns the final model's folder.

    With an ``environment``, every rollout is an episode in it: TRL's own multi-turn loop
    calls the tools and masks their results out of the loss. ``model``: where GRPO starts
    (an SFT warm-up's output); unset, the run's model_name."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOTrainer

    from workers.pipeline.callback import RunCallback
    from workers.pipeline.hooks import AgentTrainer, GatewayTrainer, stop_generating_when_cancelled
    from workers.pipeline.trackers import tracker_callbacks

    grpo = spec.grpo
    ranks = Ranks()
    if ranks.world == 1:  # the ranks' worker cleared it before it launched them
        shutil.rmtree(paths.staging, ignore_errors=True)  # half-written checkpoints of a crash
    items = [item for batch in plan for item in batch.items]
    dataset = Dataset.from_list(dataset_rows(spec.system_prompt, items))
    evaluate = bool(validation)
    eval_dataset = (
        Dataset.from_list(dataset_rows(spec.system_prompt, validation)) if evaluate else None
    )
    peft_config = None
    if grpo.lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=grpo.lora.r,
            lora_alpha=grpo.lora.alpha,
            lora_dropout=grpo.lora.dropout,
            target_modules=grpo.lora.target_modules,
            task_type="CAUSAL_LM",
        )
    if grpo.engine == "vllm-colocate":
        from workers.ml.vllm_engine import prepare_colocate

        prepare_colocate()
    bridge = StepBridge(ctx, spec, scorer, ranks=ranks)
    agent: dict[str, Any] = {}
    if environment is not None:
        agent["environment_factory"] = environment.factory
    rollouts: Any = None
    trainer_class = AgentTrainer if environment is not None else GRPOTrainer
    if spec.environment is not None and spec.environment.type == "gateway":
        from workers.gateway.rollouts import GatewayRollouts
        from workers.ml.vllm_server import LoraServers

        servers = None
        if grpo.engine == "vllm-server" and grpo.lora is not None:
            batch = grpo.groups_per_step * spec.rollouts_per_group
            servers = LoraServers(str(spec.id), grpo, paths.root / "adapters", ranks, batch)
        rollouts = GatewayRollouts(ctx, spec, _checkpoint_step(resume_from), servers, plan)
        agent["rollout_func"] = rollouts
        trainer_class = GatewayTrainer
        if grpo.async_rollouts is not None:  # LoRA on vLLM servers, checked at create
            from workers.pipeline.hooks import GatewayServerTrainer

            trainer_class = GatewayServerTrainer
    elif grpo.async_rollouts is not None:  # LoRA on vLLM servers, checked at create
        from workers.pipeline.ahead import RolloutsAhead
        from workers.pipeline.hooks import ServerTrainer

        rollouts = RolloutsAhead(ctx, spec, plan, paths.root / "adapters", ranks, bridge)
        agent["rollout_func"] = rollouts
        trainer_class = ServerTrainer
    elif grpo.engine == "vllm-server" and grpo.lora is not None:
        from workers.ml.vllm_server import ServerRollouts

        rollouts = ServerRollouts(str(spec.id), grpo, paths.root / "adapters", ranks)
        agent["rollout_func"] = rollouts
    trainer = trainer_class(
        model=model or spec.model_name,
        reward_funcs=bridge,
        args=grpo_config(
            spec,
            paths,
            len(plan),
            evaluate=evaluate,
            max_turns=environment.max_turns if environment is not None else None,
        ),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        callbacks=[
            RunCallback(ctx, spec, bridge, paths, plan),
            *tracker_callbacks(spec, paths.root, "grpo"),
            *_early_stopping(ctx, grpo, evaluate, ranks),
        ],
        **agent,
    )
    bridge.trainer = trainer
    if grpo.engine == "transformers":
        stop_generating_when_cancelled(trainer.model, ctx)
    # Trainyard records every step itself; the console printers would only flood worker logs.
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if evaluate and resume_from is None:
        trainer.evaluate()  # the base model: what every later evaluation is compared with
    # A resumed attempt whose checkpoint is the last step's (the worker died between it and
    # the final model) trains no step: the run stays where the last step left it.
    if ranks.writer and (_checkpoint_step(resume_from) or 0) < len(plan):
        ctx.runtime.run(_start_collecting(ctx))
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except BaseException as exc:
        # Land what can land; the reason training stopped is what the driver must see.
        with contextlib.suppress(Exception):
            bridge.writes.flush()
        if isinstance(exc, Exception):
            raise_if_disk_full(paths.root, paths.staging, exc)
        raise
    finally:
        if rollouts is not None:
            rollouts.close()
        if grpo.engine == "vllm-colocate" and ranks.world == 1:  # ranks exit when done
            from workers.ml.vllm_engine import release_colocate

            release_colocate(trainer)
    bridge.writes.flush()

    final = paths.final(spec.name)
    # Every rank saves (ZeRO-3 gathers the weights from all of them); rank 0 writes.
    staging = final.with_name(f".{final.name}.tmp-{ranks.share(uuid.uuid4().hex[:8])}")
    trainer.save_model(str(staging))
    ranks.wait()
    if ranks.writer:
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        shutil.rmtree(paths.staging, ignore_errors=True)
    return final


def _early_stopping(ctx: RunContext, grpo: Any, evaluate: bool, ranks: Ranks) -> list[Any]:
    """transformers' EarlyStoppingCallback when the run asks for it and can evaluate."""
    stopping = grpo.early_stopping
    if stopping is None:
        return []
    if not evaluate:
        if ranks.writer:
            ctx.runtime.run(
                ctx.event(
                    "early_stop",
                    "early_stopping is off: the run has no validation inputs to evaluate on",
                    level="warning",
                    data={"early_stopping": stopping.model_dump()},
                )
            )
        return []
    from transformers import EarlyStoppingCallback

    return [EarlyStoppingCallback(stopping.patience, stopping.threshold)]


def _checkpoint_step(checkpoint: Path | None) -> int | None:
    """The step a resumed attempt starts from (``checkpoint-N``); None: from the start."""
    if checkpoint is None:
        return 0
    try:
        return int(checkpoint.name.rpartition("-")[2])
    except ValueError:
        return None


async def _start_collecting(ctx: RunContext) -> None:
    """Whatever phase a (resumed) run was left in, its next step starts in collecting."""
    async with ctx.session() as session:
        row = await session.get(Run, ctx.run_id, populate_existing=True)
        assert row is not None
        if RunStatus(row.status) != S.COLLECTING:
            await transition(
                session,
                ctx.run_id,
                S.COLLECTING,
                fence=ctx.fence,
                message=f"step {row.step + 1}: collecting rollouts",
                data={"step": row.step + 1},
            )
