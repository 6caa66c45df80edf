"""The gateway: a user's own agent (a *harness*) plays a run's episodes through an
OpenAI-compatible endpoint backed by the run's policy (docs/gateway.md)."""
