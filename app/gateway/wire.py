"""How the API hands a gateway call to the worker that holds the run, and gets its answer.

Two Redis lists per run and one per call, on the broker every process already uses:

- the run's *inbox*: the API pushes each call (``kind: call``) and each episode that ended
  (``kind: ended``, so the worker stops waiting for it); the worker holding the run pops
  them while its step collects, answering the calls in batches;
- each API process's *reply* list: the worker pushes each answer (with its call's id) to
  the list its call names, and one task of that process hands it to the waiting call.

And one channel per run that says "episodes are waiting" to the API processes' claims.

Why not an HTTP endpoint on the worker (the sketch in DESIGN.md): nothing has to reach
the worker (no port, address or per-run secret to keep beside the lease, which a fleet
behind NAT or on Ray nodes may not have); the calls that arrive while the engine is busy
queue up and are answered as one batch; and a worker that dies leaves the calls in the
inbox for the next holder of the run instead of connection errors.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any

from app.core import jsontext

#: How long answers wait in a reply list whose API process went away.
REPLY_TTL_SECONDS = 120


def _base(prefix: str, run_id: uuid.UUID | str) -> str:
    return f"{prefix}trainyard:gateway:{run_id}"


def inbox(prefix: str, run_id: uuid.UUID | str) -> str:
    return _base(prefix, run_id) + ":inbox"


def available(prefix: str, run_id: uuid.UUID | str) -> str:
    """The channel a run's worker publishes on when episodes wait to be claimed."""
    return _base(prefix, run_id) + ":available"


def available_pattern(prefix: str) -> str:
    return f"{prefix}trainyard:gateway:*:available"


def reply(prefix: str, process: uuid.UUID | str) -> str:
    """An API process's reply list."""
    return f"{prefix}trainyard:gateway:replies:{process}"


def dumps(message: dict[str, Any]) -> bytes:
    return jsontext.dumpb(message)


def loads(raw: bytes | str) -> dict[str, Any]:
    value = jsontext.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("a gateway message is a JSON object")
    return value


# Token ids and log-probabilities as stored: packed little-endian int32 / float32.
def pack_ids(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def unpack_ids(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def pack_floats(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def unpack_floats(raw: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
