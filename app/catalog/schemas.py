"""What ``GET /catalog`` shows a key: names and descriptions, never a command, a URL, a key
or an environment variable."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.catalog.models import Catalog


class Entry(BaseModel):
    name: str = Field(description="What a run writes to use it.")
    description: str


class McpServerPublic(Entry):
    transport: Literal["stdio", "http"]


class EndpointPublic(Entry):
    model: str = Field(description="The model it serves.")


class VllmServersPublic(Entry):
    servers: int = Field(
        description="How many servers the fleet has; where Ray places them, the most one run "
        "may ask for (grpo.num_vllm_servers)."
    )
    placed_by_ray: bool = Field(
        description="Ray starts the servers for each run on the operator's cluster, serving "
        "the run's model_name (LoRA runs), and stops them with it."
    )


class ImportPrefixPublic(BaseModel):
    prefix: str = Field(
        description="Tools, environments and reward functions may be named by an import "
        "path under it (prefix.module:function)."
    )
    description: str


class ModelsPublic(BaseModel):
    folders: list[str] = Field(description="model_name may be an absolute path under these.")
    hub: list[str] = Field(description="Hub ids (or organisations, ending in '/') allowed.")


class CatalogPublic(BaseModel):
    """What runs may name. Built-in tools, environments and reward functions are always
    allowed; the OpenAPI document lists them where a run names them."""

    policy: Literal["open", "catalog"] = Field(
        description="open: a run may also name any import path, command, URL or folder; "
        "catalog: only what is listed here and the built-ins."
    )
    mcp_servers: list[McpServerPublic] = Field(description="environment: {type: mcp, server}")
    imports: list[ImportPrefixPublic]
    endpoints: list[EndpointPublic] = Field(
        description="{endpoint: NAME} for a judge, a generator or a teacher run's student."
    )
    vllm_servers: list[VllmServersPublic] = Field(description="grpo.vllm_servers")
    models: ModelsPublic

    @classmethod
    def of(cls, policy: Literal["open", "catalog"], catalog: Catalog) -> CatalogPublic:
        return cls(
            policy=policy,
            mcp_servers=[
                McpServerPublic(
                    name=name,
                    description=s.description,
                    transport="stdio" if s.command else "http",
                )
                for name, s in sorted(catalog.mcp_servers.items())
            ],
            imports=[
                ImportPrefixPublic(prefix=p.prefix, description=p.description)
                for p in catalog.imports
            ],
            endpoints=[
                EndpointPublic(name=name, description=e.description, model=e.model)
                for name, e in sorted(catalog.endpoints.items())
            ],
            vllm_servers=[
                VllmServersPublic(
                    name=name,
                    description=f.description,
                    servers=len(f.urls) if f.urls else f.ray.max_servers if f.ray else 0,
                    placed_by_ray=f.ray is not None,
                )
                for name, f in sorted(catalog.vllm_servers.items())
            ],
            models=ModelsPublic(
                folders=[str(f) for f in catalog.models.folders], hub=list(catalog.models.hub)
            ),
        )
