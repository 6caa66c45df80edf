"""What a key may do in its project: one role per key, each allowing all the one below does.

- ``viewer``: read only (dashboards, CI, notebooks): every GET.
- ``member``: also create and control runs (create, cancel, pause, resume) and upload
  datasets.
- ``admin``: also the project's admin routes: webhooks (creating, rotating, deleting them,
  and reading them and their deliveries, which show where the project's events go).

Keys are made with ``trainyard keys create --role``; keys made before roles existed are
``admin`` (migration 0013). docs/api.md "Roles" is the reference for users.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    # In order, least first: the order is the definition of "at least".
    viewer = "viewer"
    member = "member"
    admin = "admin"

    def allows(self, needed: Role) -> bool:
        """Whether a key of this role may do what ``needed`` may. (A str enum's ``<``
        compares the names as text, so the order is asked for by name, never by ``<``.)"""
        return _ORDER.index(self) >= _ORDER.index(needed)


_ORDER = tuple(Role)

# The values the database accepts (app/auth/models.py, migration 0013).
ROLE_VALUES = ", ".join(f"'{r.value}'" for r in Role)
