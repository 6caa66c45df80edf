"""Every table, imported once so ``SQLModel.metadata`` is complete (Alembic, tests)."""

from sqlmodel import SQLModel

from app.auth.models import ApiKey, Project
from app.checkpoints.models import Checkpoint
from app.core.idempotency import IdempotencyKey
from app.datasets.models import Dataset, DatasetRow
from app.events.models import RunEvent
from app.gateway.models import Episode, EpisodeCall
from app.inputs.models import TaskInput
from app.metrics.models import MetricPoint
from app.rollouts.models import GeneratedRollouts
from app.runs.models import Run
from app.trajectories.models import Trajectory
from app.webhooks.models import Webhook, WebhookDelivery

metadata = SQLModel.metadata

__all__ = [
    "ApiKey",
    "Checkpoint",
    "Dataset",
    "DatasetRow",
    "Episode",
    "EpisodeCall",
    "GeneratedRollouts",
    "IdempotencyKey",
    "MetricPoint",
    "Project",
    "Run",
    "RunEvent",
    "TaskInput",
    "Trajectory",
    "Webhook",
    "WebhookDelivery",
    "metadata",
]
