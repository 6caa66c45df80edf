"""Signed webhooks: per-project endpoints told when a run ends, pauses or saves a checkpoint.

Events reach an outbox (``webhook_deliveries``) through PostgreSQL triggers, in the
transaction that writes the event; :mod:`app.webhooks.delivery` sends them after commit.
See docs/webhooks.md.
"""
