"""ASGI entry point for uvicorn (``app.asgi:app``); one app per worker process."""

from app.main import create_app

app = create_app()
