"""The worker's side of a gateway run: it answers the episodes' model calls with the policy
being trained and turns each finished episode into TRL's sample, token for token
(docs/gateway.md)."""
