"""The operator's catalog and the code policy: what runs may name (docs/security.md)."""
