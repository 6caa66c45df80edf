#!/usr/bin/env python3
"""The plain-TRL side of ``bench/service_vs_script.py --agent``: an agent run written as a
script, no Trainyard.

The same training a Trainyard run of configs/runs/agent-calculator.yaml does — TRL's
SFTTrainer on the run's demonstrations, then TRL's GRPOTrainer with an
``environment_factory`` offering the calculator's four tools, rewarded 1 for the right
final answer — with the same SFT and GRPOConfig values the worker maps the run onto
(workers/pipeline/sft.py, ``GrpoSettings.trl_arguments`` in app/runs/spec/grpo.py), and none of
the service around it: no database, no lease, no statuses, no guarded tool calls, nothing
persisted but TRL's own checkpoints, the warm-up's model and the final model.

Its SFTConfig and GRPOConfig are written out here on purpose, value by value, as a user
following TRL's documentation would: it stands for plain TRL, so it must not borrow the
service's mapping (a mistake in that mapping would then hide in both sides).

    .venv/bin/python bench/agent_script.py --model DIR --run RUN.json --inputs-file FILE \
        [--environment package.module:Class]

``--run`` is the run as the API stores it (every default filled in: the harness writes it
with ``RunCreate.model_validate(body).model_dump(mode="json")``); ``--inputs-file`` a JSON
list of ``{"input_text", "context"}``, one per group, in training order (the harness writes
the order Trainyard's step plan takes).

Imports come first and are not timed (process start-up). Timed: the SFT warm-up (tokenizer,
examples tokenized, SFTTrainer construction, ``train()``, saving its model), then the
dataset and GRPOTrainer construction (which loads that model), ``train()`` and
``save_model()``. The last stdout line is one JSON object with the timings (the keys of
bench/grpo_script.py's, plus ``sft_seconds``), each step's duration and reward, and the
checkpoints written.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from datasets import Dataset
from grpo_script import Recorder, quiet, result
from transformers import AutoTokenizer
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.chat_template_utils import get_training_chat_template


def _plain_number(x: float) -> float | int:
    """7.0 → 7, as the calculator's tools answer."""
    x = float(x)
    return int(x) if math.isfinite(x) and x.is_integer() and abs(x) < 2**53 else x


class Calculator:
    """TRL's environment contract: ``reset`` per episode, public methods are the tools (their
    signatures and docstrings, the same as Trainyard's built-in calculator's, are the
    schemas the model sees), and the episode's expected answer kept for the reward."""

    def __init__(self) -> None:
        self.answer: Any = None

    def reset(self, context: dict[str, Any] | None = None, **_: Any) -> None:
        self.answer = (context or {}).get("answer")

    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return _plain_number(a + b)

    def subtract(self, a: float, b: float) -> float:
        """Subtract the second number from the first.

        Args:
            a: The number to subtract from.
            b: The number to subtract.
        """
        return _plain_number(a - b)

    def multiply(self, a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return _plain_number(a * b)

    def divide(self, a: float, b: float) -> float:
        """Divide the first number by the second.

        Args:
            a: The dividend.
            b: The divisor (not zero).
        """
        if b == 0:
            raise ZeroDivisionError("cannot divide by zero")
        return _plain_number(a / b)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def right_answer(completion: str, answer: Any) -> float:
    """1 when the last number of the final answer is ``answer`` (text: equal, case-folded)."""
    if answer is None:
        return 0.0
    text = completion.strip()
    try:
        expected = float(answer)
    except (TypeError, ValueError):
        return float(text.casefold() == str(answer).strip().casefold())
    found = _NUMBER.findall(text)
    return float(
        bool(found) and math.isclose(float(found[-1]), expected, rel_tol=1e-9, abs_tol=1e-9)
    )


def final_answer(completion: Any) -> str:
    """The last assistant message's content: the episode's answer."""
    if not isinstance(completion, list):
        return str(completion)
    for message in reversed(completion):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def tool_schemas(environment: type) -> list[dict[str, Any]]:
    """The tools as the chat template gets them in GRPO (TRL's rule: the class's public
    functions but reset and get_reward), for the demonstrations' prompts."""
    return [
        get_json_schema(method)
        for name, method in inspect.getmembers(environment, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]


def environment_class(path: str | None) -> type:
    """``package.module:Class``, or the script's own Calculator."""
    if path is None:
        return Calculator
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


class RewardLog(Recorder):
    """A Recorder that also keeps each step's mean reward as TRL logged it (the reward of an
    environment's own ``get_reward``, which no reward function of the script sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.rewards: list[list[float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs and state.global_step > len(self.rewards):
            self.rewards.append([float(logs["reward"])])
        super().on_log(args, state, control, logs=logs, **kw)


def chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A demonstration's message as the chat template reads it (never a missing content)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": c["function"].get("arguments") or {},
                },
            }
            for c in message["tool_calls"]
        ]
    if message["role"] == "tool" and message.get("name"):
        out["name"] = message["name"]
    return out


def tokenized(tokenizer: Any, chats: list[list[dict[str, Any]]], environment: type) -> Dataset:
    """Each demonstration tokenized with TRL's training chat template, the mask on the
    assistant's tokens (what ``assistant_only_loss`` does). Pre-tokenized, because an Arrow
    column of tool calls would unify every call's arguments into one struct."""
    template = get_training_chat_template(tokenizer)
    tools = tool_schemas(environment)
    rows = []
    for chat in chats:
        out = tokenizer.apply_chat_template(
            [chat_message(m) for m in chat],
            tools=tools,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        rows.append(
            {"input_ids": list(out["input_ids"]), "assistant_masks": list(out["assistant_masks"])}
        )
    return Dataset.from_list(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="An agent run (SFT, then GRPO with the calculator's tools) in plain TRL.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model folder (trainyard tiny-model --tools)")
    p.add_argument("--run", type=Path, required=True, help="the resolved run, JSON")
    p.add_argument("--inputs-file", type=Path, required=True, help="JSON list, one per group")
    p.add_argument("--output-dir", type=Path, help="checkpoints and models (default: temp)")
    p.add_argument(
        "--environment",
        help="package.module:Class, the environment the run names (rewarded by its"
        " get_reward); default: the calculator of this script, rewarded for the right answer",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = json.loads(args.run.read_text())
    grpo, sft = run["grpo"], run["sft"]
    inputs = json.loads(args.inputs_file.read_text())
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="agent-script-"))
    cuda = torch.cuda.is_available()
    environment = environment_class(args.environment)
    rewards_per_call: list[list[float]] = []

    def reward_fn(completions: list[Any], environments: list[Calculator], **_: Any) -> list[float]:
        rewards = [
            right_answer(final_answer(c), e.answer)
            for c, e in zip(completions, environments, strict=True)
        ]
        rewards_per_call.append(rewards)
        return rewards

    reward_fn.__name__ = "environment"
    # An environment of the run's own is rewarded by its get_reward, which TRL adds by itself.
    own_reward = args.environment is not None
    recorder = RewardLog() if own_reward else Recorder()
    g = run["rollouts_per_group"]
    accumulation = grpo["gradient_accumulation_steps"]
    system = [{"role": "system", "content": run["system_prompt"]}] if run["system_prompt"] else []

    cpu0 = time.process_time()
    t0 = time.monotonic()
    # The warm-up, its settings as workers/pipeline/sft.py maps them.
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sft_trainer = quiet(
        SFTTrainer(
            model=args.model,
            args=SFTConfig(
                output_dir=str(out / "sft" / "staging"),
                num_train_epochs=sft["epochs"],
                learning_rate=sft["learning_rate"],
                per_device_train_batch_size=sft["batch_size"],
                max_length=sft["max_seq_length"],
                packing=sft["packing"],
                seed=grpo["seed"],
                logging_steps=1,
                save_strategy="epoch",
                save_total_limit=2,
                report_to=[],
                disable_tqdm=True,
                bf16=grpo["bf16"] and cuda,
                fp16=grpo["fp16"] and cuda,
                gradient_checkpointing=grpo["gradient_checkpointing"],
                use_cpu=not cuda,
            ),
            train_dataset=tokenized(
                tokenizer, [e["messages"] for e in sft["examples"]], environment
            ),
            processing_class=tokenizer,
        )
    )
    sft_trainer.train()
    warmed = out / "sft" / "model"
    sft_trainer.save_model(str(warmed))
    tokenizer.save_pretrained(str(warmed))
    t_sft = time.monotonic()

    # GRPO from the warm-up's model, its settings as training.py's grpo_config maps them.
    dataset = Dataset.from_list(
        [
            {
                "prompt": [*system, {"role": "user", "content": i["input_text"]}],
                # The context object, as Trainyard's reset gets it.
                "context": i.get("context") or {},
            }
            for i in inputs
        ]
    )
    config = GRPOConfig(
        output_dir=str(out / "staging"),
        learning_rate=run["learning_rate"],
        max_steps=run["max_steps"],
        num_train_epochs=1,
        num_generations=g,
        per_device_train_batch_size=grpo["groups_per_step"] * g // accumulation,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        shuffle_dataset=False,
        seed=grpo["seed"],
        beta=grpo["beta"],
        loss_type=grpo["loss_type"],
        scale_rewards=grpo["scale_rewards"],
        temperature=grpo["temperature"],
        top_p=grpo["top_p"],
        top_k=grpo.get("top_k") or 0,
        min_p=grpo.get("min_p"),
        repetition_penalty=grpo["repetition_penalty"],
        max_completion_length=grpo["max_completion_length"],
        warmup_steps=grpo["warmup_ratio"],
        weight_decay=grpo["weight_decay"],
        max_grad_norm=grpo["max_grad_norm"],
        gradient_checkpointing=grpo["gradient_checkpointing"],
        bf16=grpo["bf16"] and cuda,
        fp16=grpo["fp16"] and cuda,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="steps",
        save_steps=grpo["save_steps"],
        save_total_limit=None,
        report_to=[],
        disable_tqdm=True,
        max_tool_calling_iterations=run["environment"]["max_turns"],
    )
    trainer = quiet(
        GRPOTrainer(
            model=str(warmed),
            reward_funcs=None if own_reward else reward_fn,
            args=config,
            train_dataset=dataset,
            callbacks=[recorder],
            environment_factory=environment,
        )
    )
    t1 = time.monotonic()
    trainer.train()
    t2 = time.monotonic()
    final = out / "final"
    trainer.save_model(str(final))
    t3 = time.monotonic()
    cpu = time.process_time() - cpu0

    printed = {
        "sft_seconds": t_sft - t0,
        **result(
            trainer,
            recorder,
            recorder.rewards if isinstance(recorder, RewardLog) else rewards_per_call,
            out,
            final,
            started=t0,
            built=t1,
            trained=t2,
            saved=t3,
            cpu=cpu,
        ),
        "sft_steps": sft_trainer.state.global_step,
    }
    sys.stdout.flush()
    print(json.dumps(printed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
