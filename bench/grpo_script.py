#!/usr/bin/env python3
"""The plain-TRL side of bench/service_vs_script.py: GRPO written as a script, no Trainyard.

The same training a Trainyard run of configs/runs/letters.yaml does — TRL's GRPOTrainer,
the same GRPOConfig values the worker maps a run's settings onto, reward = the fraction of
characters equal to 'a' — with none of the service around it: no database, no lease, no
statuses, nothing persisted but TRL's own checkpoints and the final model.

Its GRPOConfig is written out here on purpose, value by value, as a user following TRL's
documentation would: it stands for plain TRL, so it must not borrow the service's mapping
(``GrpoSettings.trl_arguments``; a mistake there would then hide in both sides).

    .venv/bin/python bench/grpo_script.py --model DIR --steps 100 --prompts-file FILE

Imports come first and are not timed (process start-up). Timed: building the dataset and
the GRPOTrainer (which loads the model and tokenizer), ``train()``, and ``save_model()``
of the final model. The last stdout line is one JSON object with the timings, each step's
duration and reward, and the checkpoints written.

``--prompts-file`` is a JSON list of input texts, one per group, in training order (the
harness writes the order Trainyard's step plan takes); without it the six letters.yaml
prompts are cycled in file order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import transformers
import trl
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer

LETTERS_PROMPTS = [
    "Say something.",
    "What is your favourite letter?",
    "Write a word.",
    "Sing.",
    "Shout.",
    "Whisper.",
]


def char_fraction(completion: str, char: str = "a") -> float:
    """Trainyard's built-in ``char_fraction``: the share of the completion's characters
    that are ``char``."""
    return completion.count(char) / len(completion) if completion else 0.0


class Recorder(TrainerCallback):  # type: ignore[misc]
    """Per-step timings, measured the way Trainyard's worker measures ``step_seconds``:
    from ``on_step_begin`` to the step's ``on_log`` (after the optimizer step, before any
    checkpoint save). ``log_times`` are the monotonic times of each step's ``on_log``."""

    def __init__(self) -> None:
        self.started = 0.0
        self.first_begin: float | None = None
        self.step_seconds: list[float] = []
        self.log_times: list[float] = []
        self.saves: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.started = time.monotonic()
        if self.first_begin is None:
            self.first_begin = self.started

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs and "loss" in logs and state.global_step > len(self.step_seconds):
            now = time.monotonic()
            self.step_seconds.append(now - self.started)
            self.log_times.append(now)

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.saves.append(state.global_step)


def quiet(trainer: Any) -> Any:
    """The trainer without its console output (the printer and the progress bar)."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def result(
    trainer: Any,
    recorder: Recorder,
    rewards_per_call: list[list[float]],
    out: Path,
    final: Path | None,
    *,
    started: float,
    built: float,
    trained: float,
    saved: float,
    cpu: float,
) -> dict[str, Any]:
    """What a script prints last (the monotonic times: ``started``, the trainer ``built``,
    ``trained``, the final model ``saved``): timings, each step's duration and reward, the
    checkpoints written, the versions."""
    step_rewards = [statistics.fmean(r) for r in rewards_per_call]
    intervals = [b - a for a, b in itertools.pairwise(recorder.log_times)]
    return {
        "load_seconds": built - started,
        "train_seconds": trained - built,
        "save_seconds": saved - trained,
        "total_seconds": saved - started,
        # Phase boundaries shared with the service's events: step 1 begins, last step logged.
        "first_step_seconds": (recorder.first_begin or built) - started,
        "last_step_seconds": (recorder.log_times[-1] if recorder.log_times else trained) - started,
        "cpu_seconds": cpu,
        "steps": trainer.state.global_step,
        "step_seconds": recorder.step_seconds,
        "step_seconds_median": statistics.median(recorder.step_seconds),
        "step_interval_median": statistics.median(intervals) if intervals else None,
        "step_rewards": step_rewards,
        "final_reward": step_rewards[-1] if step_rewards else None,
        "final_reward_last10": statistics.fmean(step_rewards[-10:]) if step_rewards else None,
        "checkpoints": sorted(
            (p.name for p in (out / "staging").glob("checkpoint-*")),
            key=lambda name: int(name.rsplit("-", 1)[1]),
        ),
        "saves": recorder.saves,
        "final_model": str(final) if final else None,
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version(),
        },
    }


class BusyThread:
    """Pure Python work on a second thread: ``ms`` of CPU every 100 ms, like the database
    thread of a worker writing alongside training. It shares the GIL with training."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start, cpu0 = time.monotonic(), time.thread_time()
            while (time.thread_time() - cpu0) * 1e3 < self.ms:
                sum(range(1000))
            self.cpu += time.thread_time() - cpu0
            self._stop.wait(max(0.0, 0.1 - (time.monotonic() - start)))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="GRPO on a tiny model with plain TRL (the baseline of service_vs_script.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model folder (trainyard tiny-model DIR)")
    p.add_argument("--steps", type=int, default=100, help="max_steps")
    p.add_argument("--prompts-file", type=Path, help="JSON list of prompts, one per group")
    p.add_argument("--output-dir", type=Path, help="checkpoints and final model (default: temp)")
    p.add_argument("--rollouts-per-group", type=int, default=8, help="num_generations")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--warmup", type=float, default=0.0, help="warmup_steps (below 1: a ratio)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--scale-rewards", default="group")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument(
        "--no-final-save",
        action="store_true",
        help="skip save_model() of the final model (Trainyard always saves one)",
    )
    p.add_argument("--char", default="a", help="the character whose share is the reward")
    p.add_argument(
        "--busy-thread-ms",
        type=float,
        default=0.0,
        help="run a second Python thread that burns this much CPU every 100 ms (what a"
        " worker's database thread does alongside training); 0: none",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prompts_file:
        prompts = json.loads(args.prompts_file.read_text())
    else:
        n = args.steps * args.groups_per_step
        prompts = [LETTERS_PROMPTS[i % len(LETTERS_PROMPTS)] for i in range(n)]
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="grpo-script-"))
    rewards_per_call: list[list[float]] = []

    def reward_fn(completions: list[Any], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        rewards = [char_fraction(t, args.char) for t in texts]
        rewards_per_call.append(rewards)
        return rewards

    reward_fn.__name__ = "char_fraction"
    recorder = Recorder()
    per_step = args.groups_per_step * args.rollouts_per_group

    busy = BusyThread(args.busy_thread_ms) if args.busy_thread_ms > 0 else None
    cpu0 = time.process_time()
    t0 = time.monotonic()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
    config = GRPOConfig(
        output_dir=str(out / "staging"),
        learning_rate=args.learning_rate,
        max_steps=args.steps,
        num_train_epochs=1,
        num_generations=args.rollouts_per_group,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        shuffle_dataset=False,
        seed=args.seed,
        beta=args.beta,
        loss_type=args.loss_type,
        scale_rewards=args.scale_rewards,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        max_completion_length=args.max_completion_length,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=None,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = quiet(
        GRPOTrainer(
            model=args.model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=dataset,
            callbacks=[recorder],
        )
    )
    t1 = time.monotonic()
    trainer.train()
    t2 = time.monotonic()
    final = None
    if not args.no_final_save:
        final = out / "final"
        trainer.save_model(str(final))
    t3 = time.monotonic()
    cpu = time.process_time() - cpu0
    busy_cpu = busy.stop() if busy else 0.0

    printed = {
        **result(
            trainer,
            recorder,
            rewards_per_call,
            out,
            final,
            started=t0,
            built=t1,
            trained=t2,
            saved=t3,
            cpu=cpu,
        ),
        "busy_thread_cpu_seconds": busy_cpu,
    }
    sys.stdout.flush()
    print(json.dumps(printed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
