"""The operator's catalog: what runs may name for the workers to run or reach.

A YAML file (``TRAINYARD_CATALOG``), read by the API and by every worker when they start.
Under the ``catalog`` code policy a run may name only what is here (and the built-ins);
under ``open`` it may name anything, and the catalog's entries are there to be used by name.
docs/security.md has the format with an example; ``configs/catalog.example.yaml`` is one.

.. code-block:: yaml

    mcp_servers:
      browser:
        description: A headless browser's tools
        command: [python, -m, acme.browser_mcp]
        env: {HEADLESS: "1"}
    imports:
      - prefix: acme.rewards
        description: Reward functions of the agents team
    endpoints:
      big-judge:
        description: Qwen3-32B for judging
        base_url: http://judge.internal:8000/v1
        model: Qwen/Qwen3-32B
        api_key_env: JUDGE_API_KEY
    vllm_servers:
      rollouts:
        description: The rollout fleet (Qwen2.5-7B-Instruct, LoRA enabled)
        urls: [http://vllm-0.internal:8000, http://vllm-1.internal:8000]
      placed:
        description: vLLM servers Ray starts for each run (grpo.num_vllm_servers)
        ray: {command: [vllm, serve], args: [--max-model-len, "8192"], max_servers: 4}
    harnesses:
      sandbox-agent:
        description: The coding agent's harness (gateway runs in push mode)
        url: http://agents.internal:9000/episodes
    models:
      folders: [/models]
      hub: [Qwen/]
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.core.storable import HTTP_URL_PATTERN

#: A catalog entry's name, as runs write it (``server: browser``, ``endpoint: big-judge``).
ENTRY_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
#: An import-path prefix: a dotted module path (``acme.rewards``).
MODULE_PREFIX = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
#: A hub id (``Qwen/Qwen2.5-0.5B``) or an organisation's prefix (``Qwen/``).
HUB_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/([A-Za-z0-9][A-Za-z0-9_.-]*)?)?$"
# A run's hub id, before it is compared with the catalog's: one or two names, no '..'.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*"
_RUN_HUB_ID = re.compile(rf"{_SEGMENT}(/{_SEGMENT})?\Z")
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"

Name = Annotated[str, Field(pattern=ENTRY_NAME)]
Url = Annotated[str, Field(pattern=HTTP_URL_PATTERN, max_length=2000)]


class _Entry(BaseModel):
    # A typo in the operator's file is an error at start, not an entry silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = Field(
        default="", max_length=2000, description="What it is, shown to every key (GET /catalog)."
    )


class McpServer(_Entry):
    """An MCP server a run names with ``environment: {type: mcp, server: NAME}``."""

    command: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="The argv of a server started over stdio."
    )
    url: Url | None = Field(default=None, description="A server over streamable HTTP.")
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(
        default_factory=dict, description="Environment variables of a stdio server."
    )

    @model_validator(mode="after")  # after: it runs when neither is given too
    def _command_or_url(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command and url")
        return self


class ImportPrefix(_Entry):
    """Code on the workers' path that runs may name: tools, environments, reward functions
    whose import path is ``prefix`` or under it (``acme.rewards:f``, ``acme.rewards.x:f``)."""

    prefix: str = Field(pattern=MODULE_PREFIX, max_length=300)

    def admits(self, path: str) -> bool:
        """Whether the import path ``path`` (``module:attr`` or ``module.attr``) lies under
        this prefix: ``acme.rewards`` admits ``acme.rewards:f`` but not ``acme.rewardsx:f``."""
        return path.startswith(self.prefix) and path[len(self.prefix) : len(self.prefix) + 1] in (
            ".",
            ":",
        )


class Endpoint(_Entry):
    """An OpenAI-compatible chat endpoint: a judge, an input generator, a teacher run's
    student. Runs name it with ``{endpoint: NAME}`` wherever they could give a base_url."""

    base_url: Url
    model: str = Field(min_length=1, max_length=300)
    api_key_env: str | None = Field(
        default=None,
        pattern=_ENV_NAME,
        description="The environment variable on the workers that holds its API key.",
    )


class Harness(_Entry):
    """A harness a push-mode gateway run hands its episodes to: the worker POSTs each episode
    to ``url`` and takes the answer as its finish (``environment.harness: NAME``)."""

    url: Url


class RayPlacedVllm(BaseModel):
    """vLLM servers that Ray starts for each run that names the fleet, on the cluster of
    ``TRAINYARD_RAY_ADDRESS``, and stops with the run's attempt
    (workers/pipeline/ray_servers.py). The command is the operator's; the worker adds the
    run's model, the node's address and port, and LoRA loading at runtime."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1,
        description="The vLLM OpenAI server as the nodes run it: [vllm, serve] or [/opt/vllm/"
        "bin/python, -m, vllm.entrypoints.openai.api_server]. The worker appends --model, "
        "--host, --port, --enable-lora, --max-lora-rank and --max-loras, then args.",
    )
    args: list[str] = Field(
        default_factory=list,
        description="More of the server's flags, after the worker's (--max-model-len, --dtype).",
    )
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(default_factory=dict)
    max_servers: int = Field(
        default=8, ge=1, le=64, description="The most servers one run may ask for."
    )
    gpus_per_server: int = Field(default=1, ge=0, le=64, description="0: CPU servers.")
    cpus_per_server: int = Field(default=1, ge=1, le=1024)
    startup_timeout_seconds: float = Field(
        default=600,
        gt=0,
        le=7200,
        description="Longest wait, once placed, for a server's actor to start and the server to "
        "answer /health.",
    )


class VllmServers(_Entry):
    """A fleet of vLLM servers a run's rollouts may use (``grpo.vllm_servers: NAME``): the
    servers a team runs (``urls``), or servers Ray places for each run (``ray``)."""

    urls: list[Url] | None = Field(default=None, min_length=1, max_length=64)
    ray: RayPlacedVllm | None = None

    @model_validator(mode="after")
    def _urls_or_ray(self) -> VllmServers:
        if (self.urls is None) == (self.ray is None):
            raise ValueError("give exactly one of urls and ray")
        return self


class Models(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    folders: list[Path] = Field(
        default_factory=list,
        description="Absolute folders that model_name (and a student_model) may be in.",
    )
    hub: list[Annotated[str, Field(pattern=HUB_ID)]] = Field(
        default_factory=list,
        description="Hub ids runs may name (Qwen/Qwen2.5-0.5B), or an organisation's (Qwen/).",
    )

    @field_validator("folders")
    @classmethod
    def _absolute(cls, value: list[Path]) -> list[Path]:
        for folder in value:
            if not folder.is_absolute():
                raise ValueError(f"{folder} is not an absolute path")
        return [Path(posixpath.normpath(folder)) for folder in value]

    def hub_admits(self, name: str) -> bool:
        """Whether ``name`` is a hub id listed, or of an organisation listed (``Qwen/``)."""
        if not _RUN_HUB_ID.match(name):  # '..', a trailing '/', a deeper path
            return False
        return any(
            name == allowed or (allowed.endswith("/") and name.startswith(allowed))
            for allowed in self.hub
        )


class Catalog(BaseModel):
    """The whole file. Every section is optional; an empty catalog offers the built-ins only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mcp_servers: dict[Name, McpServer] = Field(default_factory=dict)
    imports: list[ImportPrefix] = Field(default_factory=list)
    endpoints: dict[Name, Endpoint] = Field(default_factory=dict)
    vllm_servers: dict[Name, VllmServers] = Field(default_factory=dict)
    harnesses: dict[Name, Harness] = Field(default_factory=dict)
    models: Models = Field(default_factory=Models)


class CatalogError(Exception):
    """The catalog file cannot be read or is not a valid catalog (the process stops)."""


def load_catalog(path: Path | None) -> Catalog:
    """The catalog at ``path`` (None: the empty catalog); raises :class:`CatalogError` with
    every problem named by where it is in the file."""
    if path is None:
        return Catalog()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"catalog {path}: cannot be read: {exc}") from exc
    try:
        return Catalog.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise CatalogError(f"catalog {path}: {problems}") from None
