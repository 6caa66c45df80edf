"""``python -m app.cli``: what ``trainyard`` runs (``up`` starts its children this way)."""

from app.cli import main

if __name__ == "__main__":
    main()
