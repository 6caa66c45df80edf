"""A run's settings as a worker works from them: the stored body, parsed once.

The API validates a run's body with the request models of this package (``RunCreate`` and
its parts) and stores each part with ``model_dump``; a worker reads the row back into the
same models, typed, with their defaults and help text, instead of reading JSON by key. What
changes while a run goes on (status, step, metrics) is the row's, not the spec's.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, ValidationError

from app.runs.models import Run
from app.runs.spec.environments import EnvironmentSpec
from app.runs.spec.grpo import GrpoSettings
from app.runs.spec.rewards import JudgeEndpoint, RewardSpec
from app.runs.spec.sft import SftSettings
from app.runs.spec.teacher import TeacherSettings


class SpecUnreadable(ValueError):
    """A stored run whose settings no longer parse (written past the API, or by a version
    whose fields are gone): the run fails saying which field."""


class RunSpec(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True)

    id: uuid.UUID
    project_id: uuid.UUID
    model_name: str
    trained_model_name: str | None
    task_description: str
    system_prompt: str | None
    learning_key: str | None
    num_examples: int
    rollouts_per_group: int
    learning_rate: float
    num_epochs: int
    max_steps: int | None
    parent_run_id: uuid.UUID | None
    parent_step: int | None
    grpo: GrpoSettings
    reward: RewardSpec
    environment: EnvironmentSpec | None
    generator: JudgeEndpoint | None
    sft: SftSettings | None
    teacher: TeacherSettings | None

    @classmethod
    def of(cls, run: Run) -> RunSpec:
        """The spec of a loaded run (its catalog names already resolved by the worker)."""
        try:
            return cls.model_validate(run, from_attributes=True)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise SpecUnreadable(f"the stored run's {where}: {first['msg']}") from None

    @property
    def name(self) -> str:
        """What the run trains, or its id: the final model's folder, the trackers' name."""
        return self.trained_model_name or f"run-{self.id}"
