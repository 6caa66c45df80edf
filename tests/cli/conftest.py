"""The CLI through its real entry point; a module that keeps a `trainyard up` running gets a
database of its own."""

from tests.support.database import module_database  # noqa: F401  (fixture)
