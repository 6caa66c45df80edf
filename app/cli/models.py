"""Models on this machine: ``trainyard tiny-model`` (the tiny Llama the demo and the tests
train), and the model folders a run body names, made absolute before the body is sent
(the worker reads them from another working directory)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.common import CliError, err, settings


def _looks_like_path(value: str) -> bool:
    """A hub model id is ``name`` or ``org/name``; anything else with a slash, or starting
    with a dot or a tilde, can only be a folder."""
    return value.startswith((".", "~", "/")) or value.count("/") > 1 or value.endswith("/")


# The fields of a run body that name a model the worker loads: a folder or a hub id.
MODEL_FIELDS = ("model_name", "teacher.student_model")


def local_model_path(value: str, bases: Sequence[Path], where: str, field: str) -> str:
    """A model ``field`` made absolute against the first of ``bases`` holding it, since the
    worker reads it from another working directory; a hub id is left as it is."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    for base in bases:
        if (base / path).is_dir():
            return str((base / path).resolve())
    if _looks_like_path(value):
        tried = " or ".join(str(b) for b in dict.fromkeys(bases))
        raise CliError(
            f"{field} {value!r} ({where}) is not a folder in {tried}: give an absolute path "
            "(`trainyard tiny-model` builds the tiny model and prints its path)"
        )
    return value


def absolute_model_paths(body: dict[str, Any], preset: Path, overrides: list[str]) -> None:
    """Each of :data:`MODEL_FIELDS` the body names, relative, made absolute: a preset's
    against the preset's folder then the current one, an override's against the current
    folder (where it was typed)."""
    cwd = Path.cwd()
    overridden = {item.partition("=")[0].strip() for item in overrides}
    for field in MODEL_FIELDS:
        *parents, name = field.split(".")
        node: Any = body
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(name), str):
            continue
        if field in overridden:
            bases, where = [cwd], "from the override"
        else:
            bases, where = [preset.resolve().parent, cwd], f"from {preset}"
        node[name] = local_model_path(node[name], bases, where, field)


def tiny_model(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Folder to write to. Default: `<home>/models/tiny-llama` "
            "(`tiny-llama-tools` with --tools)."
        ),
    ] = None,
    seed: int = 0,
    tools: Annotated[
        bool,
        typer.Option(
            "--tools",
            help="The agent variant: a chat template with a tool-call format TRL parses "
            "(Qwen2.5's), for runs with an environment.",
        ),
    ] = False,
    width: Annotated[
        int,
        typer.Option(
            min=32,
            help="Hidden size, a multiple of 32 (256: a model whose training takes a "
            "real share of a step, for benchmarks).",
        ),
    ] = 64,
    layers: Annotated[int, typer.Option(min=1, help="Decoder layers.")] = 2,
) -> None:
    """Build the tiny Llama and tokenizer used by the demo and the tests (no hub access);
    prints the folder's absolute path, which a run's model_name can take as it is."""
    if width % 32:
        raise typer.BadParameter(f"{width} is not a multiple of 32", param_hint="--width")
    if path is None:
        from app.cli.installation import find_installation

        config = settings()
        found = find_installation(config)
        home = Path(found.home) if found else config.home.expanduser().resolve()
        path = home / "models" / ("tiny-llama-tools" if tools else "tiny-llama")
    path = path.expanduser().resolve()
    # Built by the workers' code, in a process of its own (it imports torch).
    subprocess.run(
        [sys.executable, "-m", "workers", "tiny-model", str(path), str(seed)]
        + (["--tools"] if tools else [])
        + ["--width", str(width), "--layers", str(layers)],
        check=True,
    )
    err.print(f"tiny model written to {path}", highlight=False)
    print(path, flush=True)
