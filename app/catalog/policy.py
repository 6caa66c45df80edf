"""The code policy: what a run may name for the workers to run or reach, checked twice.

The API checks a run when it is created (a 422 naming the field and saying what the catalog
offers); every worker checks it again when it loads the run, before it imports, starts or
calls anything the run names, so an API and a worker configured differently cannot be
played against each other (a row written past the API is refused too). Both read a run in
the same shape, its body as JSON (``RunCreate.model_dump()`` on one side, the stored row's
columns on the other), and both call :meth:`CodePolicy.refusals`.

What a run can name, field by field: ``model_name`` and ``teacher.student_model`` (a folder
or hub id); import paths of tools (``environment.tools``), an environment
(``environment.factory``), reward functions (``reward.functions[].name``) and evaluation
metrics (``grpo.eval_metrics[].name``); an MCP server
(``environment.command`` / ``url`` / ``server``); OpenAI-compatible endpoints (``generator``,
``reward.judge``, ``reward.small_model`` / ``large_model``, ``teacher.student_endpoint``);
vLLM servers (``grpo.vllm_server_url`` / ``vllm_servers``). Under ``open`` anything goes and
catalog names must exist; under ``catalog`` only built-ins and catalog entries do.

The worker then :meth:`~CodePolicy.resolve`-s the names into what they stand for (the
command, the URL, the key's variable), so the rest of the pipeline never sees a name; the
stored run keeps the names, and GET /runs never shows what they stand for.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from app.catalog.models import Catalog, RayPlacedVllm, load_catalog
from app.core.domain import InvalidInput
from app.core.errors import NOT_IN_CATALOG
from app.core.settings import Settings

Mode = Literal["open", "catalog"]


#: The fields of a run, body or stored row alike, that can name code, commands, hosts or
#: folders: all that :meth:`CodePolicy.refusals` reads (and :meth:`~CodePolicy.resolve` may
#: change); of ``grpo``, only :data:`GRPO_NAMING`.
NAMING = ("model_name", "environment", "reward", "generator", "teacher", "grpo")
GRPO_NAMING = ("vllm_server_url", "vllm_servers", "num_vllm_servers", "lora", "eval_metrics")


@dataclass(frozen=True)
class Refusal:
    """One thing a run names that the policy does not allow. ``field`` is the run body's
    path (``environment.command``, ``reward.functions[0].name``)."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class NotInCatalog(InvalidInput):
    """A run names something the code policy does not allow (a 422 naming the field)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message, field=f"body.{refusal.field}", error_type=NOT_IN_CATALOG)
        self.refusal = refusal


class RunRefused(Exception):
    """A worker refuses the run it was handed: the run fails with this reason."""


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "none"


@dataclass(frozen=True)
class CodePolicy:
    mode: Mode
    catalog: Catalog
    source: Path | None = None  # the catalog's file

    @classmethod
    def from_settings(cls, settings: Settings) -> CodePolicy:
        """The policy a process runs under; raises CatalogError on a bad catalog file."""
        return cls(settings.policy, load_catalog(settings.catalog), settings.catalog)

    def summary(self) -> str:
        """One line for a process's start: the policy, and what its catalog holds."""
        c = self.catalog
        held = (
            f"MCP servers {len(c.mcp_servers)}, import prefixes {len(c.imports)}, endpoints "
            f"{len(c.endpoints)}, vLLM fleets {len(c.vllm_servers)}, harnesses "
            f"{len(c.harnesses)}, model folders "
            f"{len(c.models.folders)}, hub ids {len(c.models.hub)}"
        )
        line = f"code policy {self.mode}; catalog {self.source or '(none)'}: {held}"
        if self.refuses_every_run:
            line += " (no model folder or hub id: every run will be refused until one is listed)"
        return line

    @property
    def refuses_every_run(self) -> bool:
        """Under ``catalog`` with no model folder or hub id, no run can name a model: what a
        process started without its catalog says at start (a warning, not an error: the
        API still serves every run it already has)."""
        models = self.catalog.models
        return not self.open and not (models.folders or models.hub)

    @property
    def open(self) -> bool:
        return self.mode == "open"

    # -- checking ----------------------------------------------------------------------------

    def check(self, spec: Mapping[str, Any]) -> None:
        """Raise :class:`NotInCatalog` for the first thing ``spec`` may not name (the API)."""
        for refusal in self.refusals(spec):
            raise NotInCatalog(refusal)

    def refusals(self, spec: Mapping[str, Any], *, on_worker: bool = False) -> list[Refusal]:
        """Everything ``spec`` (a run body as JSON) names that this policy does not allow.
        ``on_worker``: the model folders are resolved on this machine (symbolic links
        followed, a hub id that is also a folder here refused)."""
        return list(self._refusals(spec, on_worker))

    def _refusals(self, spec: Mapping[str, Any], on_worker: bool) -> Iterator[Refusal]:
        yield from self._model("model_name", spec.get("model_name"), on_worker)
        yield from self._environment(spec.get("environment"))
        reward = spec.get("reward") or {}
        if reward.get("type") == "function":
            for i, function in enumerate(reward.get("functions") or ()):
                yield from self._code(f"reward.functions[{i}].name", function.get("name"))
        grpo = spec.get("grpo") or {}
        for i, metric in enumerate(grpo.get("eval_metrics") or ()):
            yield from self._code(f"grpo.eval_metrics[{i}].name", metric.get("name"))
        for key in ("judge", "small_model", "large_model"):
            yield from self._endpoint(f"reward.{key}", reward.get(key))
        yield from self._endpoint("generator", spec.get("generator"))
        teacher = spec.get("teacher") or {}
        yield from self._model("teacher.student_model", teacher.get("student_model"), on_worker)
        yield from self._endpoint("teacher.student_endpoint", teacher.get("student_endpoint"))
        yield from self._vllm_servers(grpo)

    def _model(self, field: str, name: str | None, on_worker: bool) -> Iterator[Refusal]:
        if name is None or self.open:
            return
        models = self.catalog.models
        offer = (
            f"the catalog's model folders: {_listed(str(f) for f in models.folders)}; "
            f"its hub ids: {_listed(models.hub)}"
        )
        if name.startswith("/"):
            if ".." in name.split("/"):
                yield Refusal(field, f"{name!r} must not go up a folder ('..')")
                return
            path = os.path.realpath(name) if on_worker else posixpath.normpath(name)
            for folder in models.folders:
                root = os.path.realpath(folder) if on_worker else str(folder)
                if path == root or path.startswith(root.rstrip("/") + "/"):
                    return
            yield Refusal(field, f"{name!r} is in no folder the catalog lists ({offer})")
            return
        if models.hub_admits(name):
            if on_worker and os.path.exists(name):
                yield Refusal(
                    field, f"{name!r} is a hub id the catalog lists, but also a folder here"
                )
            return
        yield Refusal(
            field,
            f"{name!r} is neither an absolute path in a catalog folder nor a hub id the "
            f"catalog lists ({offer})",
        )

    def _code(self, field: str, path: str | None) -> Iterator[Refusal]:
        """An import path, or a built-in (every name without ':' or '.' is one: the request
        models refuse unknown ones)."""
        if path is None or self.open or not any(c in path for c in ".:"):
            return
        if any(prefix.admits(path) for prefix in self.catalog.imports):
            return
        yield Refusal(
            field,
            f"{path!r} is neither a built-in nor under an import prefix of the catalog "
            f"(prefixes: {_listed(p.prefix for p in self.catalog.imports)})",
        )

    def _environment(self, environment: Mapping[str, Any] | None) -> Iterator[Refusal]:
        if not environment:
            return
        kind = environment.get("type")
        if kind == "tools":
            for i, tool in enumerate(environment.get("tools") or ()):
                yield from self._code(f"environment.tools[{i}]", tool)
        elif kind == "python":
            yield from self._code("environment.factory", environment.get("factory"))
        elif kind == "gateway":
            harnesses = self.catalog.harnesses
            harness = environment.get("harness")
            if harness is not None and harness not in harnesses:
                yield Refusal(
                    "environment.harness",
                    f"no harness {harness!r} in the catalog (it has: {_listed(harnesses)})",
                )
            if environment.get("harness_url") is not None and not self.open:
                yield Refusal(
                    "environment.harness_url",
                    "under the catalog code policy a push-mode gateway run names a harness of "
                    f"the catalog (environment.harness; it has: {_listed(harnesses)}), never a "
                    "harness_url of its own",
                )
        elif kind == "mcp":
            servers = self.catalog.mcp_servers
            server = environment.get("server")
            if server is not None and server not in servers:
                yield Refusal(
                    "environment.server",
                    f"no MCP server {server!r} in the catalog (it has: {_listed(servers)})",
                )
            for key in ("command", "url"):
                if environment.get(key) is not None and not self.open:
                    yield Refusal(
                        f"environment.{key}",
                        "under the catalog code policy a run names an MCP server of the "
                        f"catalog (environment.server; it has: {_listed(servers)}), never a "
                        f"{key} of its own",
                    )

    def _endpoint(self, field: str, endpoint: Mapping[str, Any] | None) -> Iterator[Refusal]:
        if not endpoint:
            return
        endpoints = self.catalog.endpoints
        name = endpoint.get("endpoint")
        if name is not None and name not in endpoints:
            yield Refusal(
                f"{field}.endpoint",
                f"no endpoint {name!r} in the catalog (it has: {_listed(endpoints)})",
            )
        if endpoint.get("base_url") is not None and not self.open:
            yield Refusal(
                f"{field}.base_url",
                "under the catalog code policy a run names an endpoint of the catalog "
                f"({{endpoint: NAME}}; it has: {_listed(endpoints)}), never a base_url",
            )

    def _vllm_servers(self, grpo: Mapping[str, Any]) -> Iterator[Refusal]:
        fleets = self.catalog.vllm_servers
        name = grpo.get("vllm_servers")
        if name is not None:
            fleet = fleets.get(name)
            if fleet is None:
                yield Refusal(
                    "grpo.vllm_servers",
                    f"no vLLM servers {name!r} in the catalog (it has: {_listed(fleets)})",
                )
            elif fleet.ray is not None:
                asked = grpo.get("num_vllm_servers") or 1
                if grpo.get("lora") is None:
                    yield Refusal(
                        "grpo.vllm_servers",
                        f"{name!r} is vLLM servers Ray places for each run, which load the "
                        "run's LoRA adapter every step: train a LoRA adapter (grpo.lora); a "
                        "full fine-tune syncs its weights over NCCL into one `trl vllm-serve` "
                        "server of its own, which Trainyard does not place",
                    )
                elif asked > fleet.ray.max_servers:
                    yield Refusal(
                        "grpo.num_vllm_servers",
                        f"{name!r} places at most {fleet.ray.max_servers} server(s) per run",
                    )
            elif grpo.get("num_vllm_servers") is not None:
                yield Refusal(
                    "grpo.num_vllm_servers",
                    f"{name!r} is the {len(fleet.urls or ())} server(s) the operator runs; "
                    "num_vllm_servers is for a fleet Ray places (GET /catalog: placed_by_ray)",
                )
            elif grpo.get("lora") is None and len(fleet.urls or ()) > 1:
                yield Refusal(
                    "grpo.vllm_servers",
                    f"{name!r} is {len(fleet.urls or ())} servers; a full fine-tune syncs its "
                    "weights into one `trl vllm-serve` server: train a LoRA adapter, or name "
                    "a single server",
                )
        if grpo.get("vllm_server_url") is not None and not self.open:
            yield Refusal(
                "grpo.vllm_server_url",
                "under the catalog code policy a run names vLLM servers of the catalog "
                f"(grpo.vllm_servers; it has: {_listed(fleets)}), never a URL",
            )

    # -- resolving (workers) -----------------------------------------------------------------

    def resolve(
        self, spec: Mapping[str, Any], *, placed: list[str] | None = None
    ) -> dict[str, Any]:
        """The fields of ``spec`` that name catalog entries, with each name replaced by what
        it stands for, in the shape the run body gives it inline (a ``command``, a
        ``base_url``, a ``vllm_server_url``). Only changed fields are returned. Call it on a
        spec that :meth:`refusals` passed: every name exists.

        vLLM servers that Ray places have no URLs until the worker has started them:
        ``placed`` are theirs; without it the fleet's name stays (:meth:`placed_vllm`)."""
        changed: dict[str, Any] = {}
        environment = spec.get("environment")
        if environment and environment.get("server") is not None:
            server = self.catalog.mcp_servers[environment["server"]]
            changed["environment"] = {
                **environment,
                "server": None,
                "command": list(server.command) if server.command else None,
                "url": server.url,
                "env": dict(server.env),
            }
        if environment and environment.get("harness") is not None:
            changed["environment"] = {
                **environment,
                "harness": None,
                "harness_url": self.catalog.harnesses[environment["harness"]].url,
            }
        reward = spec.get("reward")
        if reward:
            named = {
                k: self._endpoint_of(reward.get(k)) for k in ("judge", "small_model", "large_model")
            }
            named = {k: v for k, v in named.items() if v is not None}
            if named:
                changed["reward"] = {**reward, **named}
        generator = self._endpoint_of(spec.get("generator"))
        if generator is not None:
            changed["generator"] = generator
        teacher = spec.get("teacher")
        if teacher:
            student = self._endpoint_of(teacher.get("student_endpoint"))
            if student is not None:
                changed["teacher"] = {**teacher, "student_endpoint": student}
        grpo = spec.get("grpo")
        fleet = self.placed_vllm((grpo or {}).get("vllm_servers"))
        if fleet is not None and placed is not None:
            changed["grpo"] = {
                **(grpo or {}),
                "vllm_servers": None,
                "num_vllm_servers": None,
                "vllm_server_url": placed,
            }
        elif fleet is None and grpo and grpo.get("vllm_servers") is not None:
            urls = list(self.catalog.vllm_servers[grpo["vllm_servers"]].urls or ())
            changed["grpo"] = {
                **grpo,
                "vllm_servers": None,
                "vllm_server_url": urls[0] if len(urls) == 1 else urls,
            }
        return changed

    def placed_vllm(self, name: str | None) -> RayPlacedVllm | None:
        """What Ray starts for the vLLM fleet ``name`` (``grpo.vllm_servers``), if Ray places it."""
        fleet = self.catalog.vllm_servers.get(name) if name is not None else None
        return fleet.ray if fleet is not None else None

    def _endpoint_of(self, endpoint: Mapping[str, Any] | None) -> dict[str, Any] | None:
        if not endpoint or endpoint.get("endpoint") is None:
            return None
        entry = self.catalog.endpoints[endpoint["endpoint"]]
        return {
            **endpoint,
            "endpoint": None,
            "base_url": entry.base_url,
            "model": entry.model,
            "api_key_env": entry.api_key_env,
        }
