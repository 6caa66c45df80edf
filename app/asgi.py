"""ASGI entry point for uvicorn (``app.asgi:app``); one app per worker process."""

import logging

from app.main import create_app

# No line the API writes shows a record's thread or process (app/core/logs.py): spare each
# record, an access line per request among them, the look-ups (a fifth of such a line's cost).
logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False

app = create_app()
