"""Metrics (Prometheus) for the API and the workers; see docs/observability.md."""
