"""Where a run's files live under the artifacts folder (shared storage on a fleet)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunPaths:
    root: Path

    @property
    def staging(self) -> Path:
        """TRL's output_dir: checkpoints appear here first, possibly half-written."""
        return self.root / "staging"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def final(self, name: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
        return self.root / "final" / safe
