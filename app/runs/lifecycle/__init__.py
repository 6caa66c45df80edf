"""A run's life: its statuses (:mod:`.status`) and the one writer of them (:mod:`.state`),
the leases workers hold runs by (:mod:`.leases`), dispatch to the queue after commit
(:mod:`.dispatch`), the reconciler (:mod:`.reconcile`) and a training step's moves
(:mod:`.step_moves`). docs/architecture.md draws it.
"""
