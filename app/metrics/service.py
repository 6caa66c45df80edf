from __future__ import annotations

import math
import uuid

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from app.metrics.models import MetricPoint


async def record(
    session: AsyncSession, run_id: uuid.UUID, step: int, values: dict[str, float]
) -> None:
    """Store one value per metric name at ``step`` (a redone step overwrites)."""
    rows = [
        {"run_id": run_id, "step": step, "name": name[:128], "value": float(value)}
        for name, value in values.items()
        if isinstance(value, int | float) and math.isfinite(value)
    ]
    if not rows:
        return
    stmt = insert(MetricPoint).values(rows)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "name", "step"], set_={"value": stmt.excluded.value}
        )
    )
