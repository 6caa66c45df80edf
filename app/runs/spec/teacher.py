"""A teacher run: GRPO trains a teacher to write guidance that makes a separate student better.

A run with a ``teacher`` block is a teacher run (the reference's TeacherGRPOTrainer). The policy
that GRPO trains (``model_name``) is the teacher and its completions are the guidance; the
student is only ever asked for answers: ``student_model``, a folder or hub id the worker
loads with transformers for inference, or ``student_endpoint``, an OpenAI-compatible
endpoint (a vLLM server).

Per input, before the first step, the student answers alone (its baseline) and answers a
diagnostic probe; the teacher's prompt is ``teacher_adaptive_template`` filled with the task
and the probe, asking for a walkthrough, hints or a verification by the student's capability
level. Each guidance is then scored by what it does: the student answers again with it, both
answers are scored by the run's reward, and the teaching reward (``reward``) turns the two
scores and the guidance's length into the reward GRPO trains on. docs/teacher.md has it all.

The reference's limits are checked here (a 422 naming the field): ``max_tokens`` below 1,
guidance ``max_tokens`` below 10, weights outside [0, 1], negative lengths. An empty task is
``task_description``'s own 422 (min_length 1); scores outside [0, 1] can only be seen by the
worker, which fails the run saying which score.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from app.core.errors import inconsistent
from app.core.storable import NulFreeStr
from app.runs.spec.rewards import JudgeEndpoint, Strict

# Capability levels that choose the guidance's form (the reference's generate_guidance):
# below WALKTHROUGH_BELOW a step-by-step walkthrough, below HINTS_BELOW hints and scaffolding,
# from there on a minimal check of the student's own approach.
WALKTHROUGH_BELOW = 0.3
HINTS_BELOW = 0.7

DEFAULT_BASELINE_TEMPLATE = "{task}"

DEFAULT_DIAGNOSTIC_TEMPLATE = (
    "Before solving it, look at this task:\n\n{task}\n\n"
    "Briefly describe what kind of problem it is, the steps it needs and where you might go "
    "wrong. Do not solve it. End with three lines:\n"
    "CAPABILITY: <how well you can solve it, 0.0 to 1.0>\n"
    "CONFIDENCE: <how sure you are of that, 0.0 to 1.0>\n"
    "GAPS: <what you do not know, comma-separated, or none>"
)

DEFAULT_TEACHER_TEMPLATE = (
    "You are teaching a student. The task:\n\n{task}\n\n"
    "The student's own assessment, before solving it:\n{probe}\n\n"
    "Capability level: {capability:.2f}; confidence {confidence:.2f}; gaps: {gaps}.\n\n"
    "{form} Do not give the final answer; keep it short."
)

DEFAULT_WITH_TEACHING_TEMPLATE = (
    "{task}\n\nA teacher's guidance:\n{guidance}\n\nNow answer the task."
)

# What the teacher is asked for at each capability level ({form} of the adaptive template).
GUIDANCE_FORMS = {
    "walkthrough": "Walk the student through the solution step by step.",
    "hints": "Give the student hints and scaffolding for the steps it is unsure of.",
    "verification": "The student is strong: only point out what to verify in its approach.",
}


def guidance_form(capability: float) -> str:
    """The form of guidance for a capability level in [0, 1]: ``walkthrough`` below 0.3,
    ``hints`` below 0.7, ``verification`` from 0.7 on."""
    if capability < WALKTHROUGH_BELOW:
        return "walkthrough"
    if capability < HINTS_BELOW:
        return "hints"
    return "verification"


def _fills(template: str, names: dict[str, object]) -> None:
    """Raise (a 422) unless ``template`` formats with exactly these placeholders available."""
    try:
        template.format(**names)
    except (KeyError, IndexError) as exc:
        known = ", ".join("{" + n + "}" for n in names)
        raise inconsistent(f"unknown placeholder {exc} (this template has {known})") from exc
    except ValueError as exc:
        raise inconsistent(f"not a str.format template: {exc}") from exc


_TASK: dict[str, object] = {"task": "t"}
_PROBE: dict[str, object] = {
    "task": "t",
    "probe": "p",
    "capability": 0.5,
    "confidence": 0.5,
    "gaps": "g",
}
_TEACHER: dict[str, object] = {**_PROBE, "form": "f"}
_WITH: dict[str, object] = {"task": "t", "guidance": "g"}


class TeachingRewardWeights(Strict):
    """The teaching reward (the reference's compute_teaching_reward), by default exactly its
    documented formula: ``improvement × (enhanced − baseline) + efficiency × max(0, 1 −
    guidance_tokens / efficiency_tokens)``, less ``safety_penalty`` when the guidance made
    the student worse (enhanced < baseline)."""

    improvement: float = Field(
        default=1.0, ge=0, le=1, description="Weight of the improvement (enhanced − baseline)."
    )
    efficiency: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Weight of the efficiency bonus max(0, 1 − guidance_tokens / "
        "efficiency_tokens).",
    )
    efficiency_tokens: int = Field(
        default=200, ge=1, le=131072, description="Guidance this long or longer earns no bonus."
    )
    safety_penalty: float = Field(
        default=2.0,
        ge=0,
        le=100,
        description="Subtracted when the guidance makes the student worse (enhanced < baseline).",
    )


class TeacherSettings(Strict):
    """A teacher run: the policy is the teacher; the student it teaches is ``student_model``
    or ``student_endpoint``."""

    student_model: NulFreeStr | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="The student: a model folder on the workers or hub id, loaded with "
        "transformers for inference only. Not with student_endpoint.",
    )
    student_endpoint: JudgeEndpoint | None = Field(
        default=None,
        description="The student as an OpenAI-compatible endpoint (e.g. a vLLM server), "
        "asked at temperature 0. Not with student_model.",
    )
    max_probe_tokens: int = Field(
        default=500, ge=1, le=131072, description="Most tokens of the student's probe answer."
    )
    max_tokens: int = Field(
        default=512,
        ge=1,
        le=131072,
        description="Most tokens of each of the student's answers (baseline and with guidance).",
    )
    guidance_max_tokens: int | None = Field(
        default=None,
        ge=10,
        le=131072,
        description="Most tokens of the teacher's guidance: for a teacher run it is TRL's "
        "max_completion_length. Unset: grpo.max_completion_length (at least 10).",
    )
    student_baseline_template: NulFreeStr = Field(
        default=DEFAULT_BASELINE_TEMPLATE,
        min_length=1,
        max_length=20_000,
        description="The student's prompt without guidance; placeholder {task}.",
    )
    student_diagnostic_template: NulFreeStr = Field(
        default=DEFAULT_DIAGNOSTIC_TEMPLATE,
        min_length=1,
        max_length=20_000,
        description="The student's diagnostic probe; placeholder {task}. Lines 'CAPABILITY: "
        "x', 'CONFIDENCE: x' and 'GAPS: a, b' in its answer are read (docs/teacher.md says "
        "what is assumed when they are missing).",
    )
    teacher_adaptive_template: NulFreeStr = Field(
        default=DEFAULT_TEACHER_TEMPLATE,
        min_length=1,
        max_length=20_000,
        description="The teacher's prompt; placeholders {task}, {probe} (the student's probe "
        "answer), {capability}, {confidence}, {gaps} and {form} (what to write at that level: "
        "a walkthrough below 0.3, hints below 0.7, a verification above).",
    )
    student_with_teaching_template: NulFreeStr = Field(
        default=DEFAULT_WITH_TEACHING_TEMPLATE,
        min_length=1,
        max_length=20_000,
        description="The student's prompt with guidance; placeholders {task} and {guidance}.",
    )
    student_system_prompt: NulFreeStr | None = Field(
        default=None,
        max_length=20_000,
        description="The student's system message; unset: none. (system_prompt is the teacher's.)",
    )
    reward: TeachingRewardWeights = Field(
        default_factory=TeachingRewardWeights,
        description="The teaching reward's weights; the default is the reference's formula.",
    )

    @field_validator("student_baseline_template")
    @classmethod
    def _baseline(cls, value: str) -> str:
        _fills(value, _TASK)
        return value

    @field_validator("student_diagnostic_template")
    @classmethod
    def _diagnostic(cls, value: str) -> str:
        _fills(value, _TASK)
        return value

    @field_validator("teacher_adaptive_template")
    @classmethod
    def _teacher(cls, value: str) -> str:
        _fills(value, _TEACHER)
        return value

    @field_validator("student_with_teaching_template")
    @classmethod
    def _with_teaching(cls, value: str) -> str:
        _fills(value, _WITH)
        if "{guidance}" not in value.replace("{{", "").replace("}}", ""):
            raise inconsistent("the template must hold {guidance}: the student would never see it")
        return value

    @model_validator(mode="after")
    def _one_student(self) -> TeacherSettings:
        if (self.student_model is None) == (self.student_endpoint is None):
            raise inconsistent("give exactly one of student_model and student_endpoint")
        return self
