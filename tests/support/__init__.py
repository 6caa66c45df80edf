"""What tests share: helpers and fixtures that any test or conftest imports from here, never
from another test module or conftest.

- ``runs``: request bodies, keyword-only row factories, reads and waits on a run.
- ``database``: tenants, and a database (and broker prefix) of a test's own.
- ``workers``: real ``trainyard worker`` processes and the tiny model they train.
- ``pipelines``: small pipelines a worker runs instead of the real one (``TRAINYARD_PIPELINE``).
- ``broker``: a Redis of a test's own, to stop and flush.
- ``llm``: a scripted OpenAI-compatible server.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
