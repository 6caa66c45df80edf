"""The GPU tier (`make test-gpu`): real runs on CUDA, on a small model from a local folder
(``TRAINYARD_GPU_MODEL``); every test skips, saying why, where there is no GPU."""

import os
from pathlib import Path

import pytest

from tests.support.database import api, own_database, sessionmaker  # noqa: F401  (fixtures)
from tests.support.workers import start_worker, worker_home  # noqa: F401  (fixtures)


@pytest.fixture
def gpus() -> int:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the GPU tier runs where one is")
    return torch.cuda.device_count()


@pytest.fixture
def gpu_model(gpus: int) -> Path:
    folder = os.environ.get("TRAINYARD_GPU_MODEL")
    if not folder or not (Path(folder) / "config.json").is_file():
        pytest.skip(
            "TRAINYARD_GPU_MODEL must name a local folder with a small chat model (e.g. "
            "Qwen2.5-0.5B-Instruct): no model is downloaded in the tests"
        )
    return Path(folder).resolve()
