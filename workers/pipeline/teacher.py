"""Teacher runs (app/runs/spec/teacher.py) in the worker: the student, its probes, the teacher's
prompts and the scorer that rewards guidance by what it does to the student's answers.

The protocol, per input:

1. before the first step (the run is ``generating``): the student's baseline answer
   (``student_baseline_template``) and its diagnostic probe (``student_diagnostic_template``,
   at most ``max_probe_tokens``), read by :func:`parse_probe`; the baseline is scored by the
   run's reward. With the teacher's prompt (``teacher_adaptive_template``, its ``{form}``
   chosen by the capability level) it is stored in ``task_inputs.teacher``, so a resumed run
   never asks again;
2. at every step GRPO generates the teacher's guidance for those prompts; the reward
   function (TRL's, :class:`~workers.pipeline.training.StepBridge`, unchanged) calls
   :class:`TeachingScorer`, which has the student answer again with each guidance
   (``student_with_teaching_template``), scores the baseline and the enhanced answers with
   the run's reward in one group, and turns each pair into the teaching reward
   (workers/rewards/teaching.py). Everything is kept in the trajectory's
   ``reward_breakdown["teacher"]``; the step's ``teacher/...`` metrics go through TRL's
   ``log_metric`` with the rest of the step's metrics.

The student is a transformers model loaded here for inference only (greedy decoding) or an
OpenAI-compatible endpoint (temperature 0).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from sqlalchemy import text as sql

from app.runs.spec.parsed import RunSpec
from app.runs.spec.teacher import GUIDANCE_FORMS, TeacherSettings, guidance_form
from workers.context import RunContext
from workers.pipeline.plan import PlannedInput
from workers.rewards import Group, Rollout, Score, Scorer
from workers.rewards.teaching import teaching_reward

# The key of a teacher run's input context (inside the worker only, never stored) that
# carries the input's probe record to the scorer; the input's own context is under CONTEXT.
RECORD = "_teacher"
CONTEXT = "_context"

Messages = list[dict[str, Any]]

# Inputs probed (and stored) at a time before the first step.
PROBE_CHUNK = 64


class TeacherRunError(RuntimeError):
    """A teacher run cannot go on: the student cannot be used, or a score is out of range."""


# -- the student's probe ---------------------------------------------------------------------

_NUMBER = r"([-+]?\d+(?:\.\d+)?)\s*(%?)"
_CAPABILITY = re.compile(r"^\W*capability(?:[ _]level)?\W*?[:=]\s*" + _NUMBER, re.I | re.M)
_CONFIDENCE = re.compile(r"^\W*confidence(?:[ _]score)?\W*?[:=]\s*" + _NUMBER, re.I | re.M)
_GAPS = re.compile(r"^\W*(?:identified[ _])?gaps\W*?[:=]\s*(.*)$", re.I | re.M)


def _level(match: re.Match[str] | None) -> float | None:
    if match is None:
        return None
    value = float(match.group(1)) / (100.0 if match.group(2) else 1.0)
    return min(1.0, max(0.0, value))


def parse_probe(answer: str, *, fallback: float) -> dict[str, Any]:
    """What the student's probe answer says of it: ``capability_level`` and
    ``confidence_score`` in [0, 1] from lines ``CAPABILITY: x`` and ``CONFIDENCE: x`` (a
    number, or a percentage with %; clipped into [0, 1]), ``identified_gaps`` from ``GAPS:
    a, b`` (``none``: no gap).

    When the student cannot say (no CAPABILITY line), ``fallback`` stands in for its
    capability level (the worker gives its baseline score: how well it did alone) with
    confidence 0; ``self_assessed`` says which."""
    capability = _level(_CAPABILITY.search(answer))
    confidence = _level(_CONFIDENCE.search(answer))
    gaps_line = _GAPS.search(answer)
    gaps: list[str] = []
    if gaps_line is not None:
        gaps = [
            g.strip()
            for g in gaps_line.group(1).split(",")
            if g.strip() and g.strip().lower() not in ("none", "n/a", "-")
        ]
    assessed = capability is not None
    return {
        "capability_level": capability if assessed else min(1.0, max(0.0, fallback)),
        "confidence_score": (confidence if confidence is not None else 0.0) if assessed else 0.0,
        "identified_gaps": gaps,
        "self_assessed": assessed,
    }


# -- students --------------------------------------------------------------------------------


class Student(Protocol):
    def check(self) -> None: ...

    def answer(self, prompts: Sequence[Messages], max_tokens: int) -> list[tuple[str, int]]:
        """One answer per prompt with the number of tokens it took."""

    def describe(self) -> str: ...


class LocalStudent:
    """A transformers model on this worker, for inference only (greedy, batched)."""

    batch_size = 16

    def __init__(self, name: str) -> None:
        self.name = name
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.name

    def check(self) -> None:
        from workers.pipeline.training import ModelUnavailable, check_model

        try:
            check_model(self.name)
        except ModelUnavailable as exc:
            raise TeacherRunError(f"teacher.student_model: {exc}") from exc

    def _load(self) -> tuple[Any, Any]:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.name)
            tokenizer.padding_side = "left"
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            model: Any = AutoModelForCausalLM.from_pretrained(self.name, dtype="auto")
            model.to("cuda" if torch.cuda.is_available() else "cpu")
            model.eval()
            self._model, self._tokenizer = model, tokenizer
        return self._model, self._tokenizer

    def answer(self, prompts: Sequence[Messages], max_tokens: int) -> list[tuple[str, int]]:
        import torch

        with self._lock:
            model, tokenizer = self._load()
            out: list[tuple[str, int]] = []
            stop = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
            for start in range(0, len(prompts), self.batch_size):
                chunk = prompts[start : start + self.batch_size]
                texts = [
                    tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                    for p in chunk
                ]
                batch = tokenizer(
                    texts, return_tensors="pt", padding=True, add_special_tokens=False
                ).to(model.device)
                with torch.no_grad():
                    generated = model.generate(
                        **batch,
                        max_new_tokens=max_tokens,
                        do_sample=False,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                for row in generated[:, batch["input_ids"].shape[1] :].tolist():
                    ids = []
                    for token in row:
                        if token in stop:
                            break
                        ids.append(token)
                    out.append((tokenizer.decode(ids, skip_special_tokens=True), len(ids)))
            return out


class EndpointStudent:
    """An OpenAI-compatible endpoint (a vLLM server), at temperature 0. Its answers' lengths
    are counted in words: the endpoint's tokenizer is not here."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from workers.llm.client import ChatClient, Endpoint

        self.endpoint = Endpoint.from_spec(spec)
        self.client = ChatClient(self.endpoint)

    def describe(self) -> str:
        return self.endpoint.describe()

    def check(self) -> None:
        from workers.llm.client import LLMError

        try:
            self.client.check()
        except LLMError as exc:
            raise TeacherRunError(f"teacher.student_endpoint: {exc}") from exc

    def answer(self, prompts: Sequence[Messages], max_tokens: int) -> list[tuple[str, int]]:
        def one(messages: Messages) -> tuple[str, int]:
            text = self.client.chat(messages, temperature=0.0, max_tokens=max_tokens)
            return text, len(text.split())

        with ThreadPoolExecutor(max_workers=self.endpoint.max_concurrency) as pool:
            return list(pool.map(one, prompts))


# -- the run -----------------------------------------------------------------------------------

_MISSING = """
SELECT id, input_text, context FROM task_inputs
 WHERE run_id = $1 AND teacher IS NULL ORDER BY index
"""
_STORE = """
UPDATE task_inputs AS t SET teacher = r.teacher
  FROM jsonb_to_recordset(CAST(:records AS jsonb)) AS r(id uuid, teacher jsonb)
 WHERE t.run_id = :run_id AND t.id = r.id
"""
_RECORDS = "SELECT id, teacher FROM task_inputs WHERE run_id = $1"


def _messages(system: str | None, text: str) -> Messages:
    return [
        *([{"role": "system", "content": system}] if system else []),
        {"role": "user", "content": text},
    ]


class Teaching:
    """A teacher run's student, settings and scorer, for one attempt of the run."""

    def __init__(self, spec: RunSpec, settings: TeacherSettings, base: Scorer) -> None:
        self.spec = spec
        self.settings = settings
        self.base = base
        self.student: Student = (
            LocalStudent(settings.student_model)
            if settings.student_model is not None
            else EndpointStudent(settings.student_endpoint.model_dump())  # type: ignore[union-attr]
        )

    def check(self) -> None:
        """The student must answer here, and the guidance may be at least 10 tokens."""
        length = self.guidance_tokens
        if length < 10:
            raise TeacherRunError(
                f"a teacher's guidance needs at least 10 tokens; grpo.max_completion_length is "
                f"{length} (set teacher.guidance_max_tokens)"
            )
        self.student.check()

    @property
    def guidance_tokens(self) -> int:
        return self.settings.guidance_max_tokens or self.spec.grpo.max_completion_length

    def with_guidance_length(self, spec: RunSpec) -> RunSpec:
        """``spec`` as TRL must train it: TRL generates the guidance, so its
        max_completion_length is the guidance's limit. (Nothing is written back.)"""
        grpo = spec.grpo.model_copy(update={"max_completion_length": self.guidance_tokens})
        return spec.model_copy(update={"grpo": grpo})

    def student_prompt(self, template: str, **names: Any) -> Messages:
        return _messages(self.settings.student_system_prompt, template.format(**names))

    # -- before the first step ---------------------------------------------------------------

    async def probe_inputs(self, ctx: RunContext) -> int:
        """Baseline, probe and teacher's prompt of every input that has none yet (all of
        them, unless an attempt died half-way: each chunk of PROBE_CHUNK inputs is stored
        as it is done); returns how many were probed."""
        async with ctx.runtime.pg() as conn:
            rows = [dict(r) for r in await conn.fetch(_MISSING, ctx.run_id)]
        if not rows:
            return 0
        records: list[dict[str, Any]] = []
        for start in range(0, len(rows), PROBE_CHUNK):
            ctx.check(pause_ok=False)
            chunk = await asyncio.to_thread(self._probe, rows[start : start + PROBE_CHUNK])
            async with ctx.session() as session:  # fenced: only while this worker holds it
                await session.execute(
                    sql(_STORE), {"run_id": ctx.run_id, "records": json.dumps(chunk)}
                )
            records.extend(chunk)
        levels = [r["teacher"]["probe"]["capability_level"] for r in records]
        forms = [r["teacher"]["probe"]["form"] for r in records]
        await ctx.event(
            "teacher",
            f"student {self.student.describe()} probed on {len(records)} inputs: mean "
            f"capability {statistics.fmean(levels):.2f}",
            data={
                "probed": len(records),
                "capability_mean": statistics.fmean(levels),
                **{f"{form}_inputs": forms.count(form) for form in GUIDANCE_FORMS},
            },
        )
        return len(records)

    def _probe(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        s = self.settings
        tasks = [r["input_text"] for r in rows]
        contexts = [_context(r["context"]) for r in rows]
        baseline_prompts = [self.student_prompt(s.student_baseline_template, task=t) for t in tasks]
        probe_prompts = [self.student_prompt(s.student_diagnostic_template, task=t) for t in tasks]
        baselines = self.student.answer(baseline_prompts, s.max_tokens)
        probes = self.student.answer(probe_prompts, s.max_probe_tokens)
        groups = [
            Group(i, task, context, [Rollout(prompt, answer)])
            for i, (task, context, prompt, (answer, _)) in enumerate(
                zip(tasks, contexts, baseline_prompts, baselines, strict=True)
            )
        ]
        scores = [row[0] for row in self.base.score(groups)]
        records = []
        for row, task, (base_text, base_tokens), (probe_text, probe_tokens), score in zip(
            rows, tasks, baselines, probes, scores, strict=True
        ):
            baseline_score = score.reward
            probe = parse_probe(
                probe_text, fallback=baseline_score if baseline_score is not None else 0.0
            )
            form = guidance_form(probe["capability_level"])
            probe.update(answer=probe_text, probe_tokens=probe_tokens, form=form)
            prompt = s.teacher_adaptive_template.format(
                task=task,
                probe=probe_text,
                capability=probe["capability_level"],
                confidence=probe["confidence_score"],
                gaps=", ".join(probe["identified_gaps"]) or "none identified",
                form=GUIDANCE_FORMS[form],
            )
            records.append(
                {
                    "id": str(row["id"]),
                    "teacher": {
                        "task": task,
                        "baseline": {
                            "answer": base_text,
                            "tokens": base_tokens,
                            "score": baseline_score,
                        },
                        "probe": probe,
                        "teacher_prompt": prompt,
                    },
                }
            )
        return records

    async def lessons(self, ctx: RunContext, inputs: list[PlannedInput]) -> list[PlannedInput]:
        """The inputs as the teacher sees them: its prompt as the text; the probe record and
        the input's own context in the context (for :class:`TeachingScorer`)."""
        async with ctx.runtime.pg() as conn:
            stored = {
                str(r["id"]): _context(r["teacher"]) for r in await conn.fetch(_RECORDS, ctx.run_id)
            }
        out = []
        for item in inputs:
            record = stored.get(item.id)
            if not record:
                raise TeacherRunError(
                    f"input {item.index} has no student probe: it was not probed while the "
                    "run was generating"
                )
            out.append(
                replace(
                    item,
                    input_text=record["teacher_prompt"],
                    context={RECORD: record, CONTEXT: item.context},
                )
            )
        return out

    def scorer(self) -> TeachingScorer:
        return TeachingScorer(self)


def _context(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


async def for_run(ctx: RunContext, spec: RunSpec, base: Scorer) -> Teaching | None:
    """The run's teaching, or None when it is not a teacher run."""
    if spec.teacher is None:
        return None
    if spec.environment is not None:
        raise TeacherRunError(
            "a teacher run cannot have an environment yet: the teacher's guidance is one "
            "completion, not an episode"
        )
    return Teaching(spec, spec.teacher, base)


# -- the scorer ------------------------------------------------------------------------------


class TeachingScorer:
    """The run's scorer for a teacher run: a guidance's reward is what it does to the
    student's answer (the teaching reward), the answers scored by the run's own reward."""

    instant = False  # the student answers first: the rollouts are stored while it does

    def __init__(self, teaching: Teaching) -> None:
        self.teaching = teaching
        self.settings = teaching.settings
        self.base = teaching.base
        self.step_metrics: dict[str, float] = {}
        # The policy's token count of each guidance, set by StepBridge before each score()
        # (in the groups' order); None: counted here with the teacher's tokenizer.
        self.completion_tokens: list[int] | None = None
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(teaching.spec.model_name)

    def check(self) -> None:
        self.base.check()
        self.teaching.check()

    def tokens(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, groups: list[Group]) -> list[list[Score]]:
        s = self.settings
        weights = s.reward
        records = [(g.context or {})[RECORD] for g in groups]
        prompts: list[Messages] = []
        for group, record in zip(groups, records, strict=True):
            for rollout in group.rollouts:
                prompts.append(
                    self.teaching.student_prompt(
                        s.student_with_teaching_template,
                        task=record["task"],
                        guidance=rollout.completion,
                    )
                )
        answers = iter(self.teaching.student.answer(prompts, s.max_tokens))
        prompt_iter = iter(prompts)
        student_groups = []
        enhanced: list[list[tuple[str, int]]] = []
        for group, record in zip(groups, records, strict=True):
            baseline_prompt = self.teaching.student_prompt(
                s.student_baseline_template, task=record["task"]
            )
            answered = [next(answers) for _ in group.rollouts]
            enhanced.append(answered)
            student_groups.append(
                Group(
                    group.index,
                    record["task"],
                    (group.context or {}).get(CONTEXT),
                    [
                        Rollout(baseline_prompt, record["baseline"]["answer"]),
                        *(Rollout(next(prompt_iter), text) for text, _ in answered),
                    ],
                )
            )
        student_scores = self.base.score(student_groups)

        counted = self.completion_tokens
        self.completion_tokens = None  # one score() call's
        n_rollouts = sum(len(g.rollouts) for g in groups)
        lengths = iter(
            counted
            if counted is not None and len(counted) == n_rollouts
            else [self.tokens(r.completion) for g in groups for r in g.rollouts]
        )
        out: list[list[Score]] = []
        stats: dict[str, list[float]] = {
            k: [] for k in ("enhanced", "baseline", "delta", "tokens", "efficiency")
        }
        for group, record, answered, row in zip(
            groups, records, enhanced, student_scores, strict=True
        ):
            baseline = row[0]
            scores = []
            for rollout, (text, answer_tokens), score in zip(
                group.rollouts, answered, row[1:], strict=True
            ):
                guidance_tokens = next(lengths)
                detail: dict[str, Any] = {
                    "task": record["task"],
                    "probe": record["probe"],
                    "guidance": rollout.completion,
                    "guidance_tokens": guidance_tokens,
                    "baseline": {**record["baseline"], "score": baseline.reward},
                    "enhanced": {"answer": text, "tokens": answer_tokens, "score": score.reward},
                }
                breakdown: dict[str, Any] = {
                    "teacher": detail,
                    "student_scores": {"baseline": baseline.breakdown, "enhanced": score.breakdown},
                }
                if baseline.reward is None or score.reward is None:
                    # The run's reward could not score the student (a judge failed): dropped.
                    scores.append(Score(None, breakdown))
                    continue
                try:
                    parts = teaching_reward(
                        baseline.reward,
                        score.reward,
                        guidance_tokens,
                        improvement_weight=weights.improvement,
                        efficiency_weight=weights.efficiency,
                        efficiency_tokens=weights.efficiency_tokens,
                        safety_penalty=weights.safety_penalty,
                    )
                except (ValueError, TypeError) as exc:
                    raise TeacherRunError(
                        f"the run's reward scored the student {exc}: a teacher run needs "
                        "scores in [0, 1] (weight the reward functions so they stay there)"
                    ) from exc
                detail["reward"] = parts.as_dict()
                scores.append(Score(parts.reward, breakdown))
                stats["enhanced"].append(score.reward)
                stats["baseline"].append(baseline.reward)
                stats["delta"].append(score.reward - baseline.reward)
                stats["tokens"].append(guidance_tokens)
                stats["efficiency"].append(parts.efficiency)
            out.append(scores)
        self.step_metrics = _metrics(stats)
        return out


def _metrics(stats: dict[str, list[float]]) -> dict[str, float]:
    """The step's ``teacher/...`` metrics over its scored guidance (none: no metrics)."""
    if not stats["delta"]:
        return {}
    n = len(stats["delta"])
    return {
        "teacher/student_accuracy": statistics.fmean(stats["enhanced"]),
        "teacher/baseline_accuracy": statistics.fmean(stats["baseline"]),
        "teacher/delta": statistics.fmean(stats["delta"]),
        "teacher/improvement_rate": sum(1 for d in stats["delta"] if d > 0) / n,
        "teacher/degradation_rate": sum(1 for d in stats["delta"] if d < 0) / n,
        "teacher/guidance_length": statistics.fmean(stats["tokens"]),
        "teacher/token_efficiency": statistics.fmean(stats["efficiency"]),
    }
