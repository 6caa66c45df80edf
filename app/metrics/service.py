from __future__ import annotations

import json
import math
import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

_RECORD = text(
    """
    INSERT INTO metric_points (run_id, step, name, value)
    SELECT :run_id, :step, m.key, m.value::float8
      FROM jsonb_each(CAST(:values AS jsonb)) AS m(key, value)
    ON CONFLICT (run_id, name, step) DO UPDATE SET value = EXCLUDED.value
    """
)


def storable_values(values: dict[str, float]) -> dict[str, float]:
    """The values a metric point can hold: finite numbers, names cut to the column's 128."""
    return {
        name[:128]: float(value)
        for name, value in values.items()
        if isinstance(value, int | float) and math.isfinite(value)
    }


async def record(
    session: AsyncSession, run_id: uuid.UUID, step: int, values: dict[str, float]
) -> None:
    """Store one value per metric name at ``step`` (a redone step overwrites). One
    statement, the values as one JSON parameter (evaluations; a training step's metrics go
    with its status move, ``app.runs.step_moves.step_finished``)."""
    finite = storable_values(values)
    if finite:
        await session.execute(
            _RECORD, {"run_id": run_id, "step": step, "values": json.dumps(finite)}
        )
