"""Environments for agent runs: the tools a model calls over several turns of an episode.

A run's ``environment`` spec (``tools`` | ``python`` | ``mcp``, validated by
:mod:`app.runs.spec.environments`) is loaded by :func:`load_environment` into TRL's
``environment_factory``; TRL's own multi-turn loop (``GRPOTrainer``) runs the episodes.
"""

from workers.environments.loading import EnvironmentUnavailable, LoadedEnvironment, load_environment

__all__ = ["EnvironmentUnavailable", "LoadedEnvironment", "load_environment"]
