"""Rollouts generated ahead of the step that trains on them (``grpo.async_rollouts``):
durable from the moment they are generated, so a worker that dies keeps them."""
