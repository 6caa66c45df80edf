"""The dashboard at ``/ui``: one HTML page and its static files, served by the API itself.

Every page path the client-side router knows answers the same ``index.html``; the page then
reads the REST endpoints with the user's API key, exactly as any other client does, so the
dashboard sees what the key's project may see and nothing else. No build step: the files
under ``static/`` are the ones the browser runs (ES modules, one CSS file, uPlot vendored
under a folder named after its version). None of it is in the OpenAPI document.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import PathLike, StaticFiles
from starlette.types import Scope

STATIC = Path(__file__).parent / "static"
INDEX = STATIC / "index.html"

# Only our own origin, for scripts, styles and requests alike: the page runs no inline
# script and loads nothing from anywhere else.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


def _index() -> FileResponse:
    return FileResponse(INDEX, media_type="text/html", headers=_PAGE_HEADERS)


# The client-side router's paths (app/ui/static/js/app.js): each one a page to reload or share.
@router.get("")
@router.get("/")
@router.get("/runs/{run_id}")
@router.get("/runs/{run_id}/trajectories")
@router.get("/compare")
async def page() -> FileResponse:
    return _index()


class Static(StaticFiles):
    """Static files that revalidate (ETag, ``no-cache``), except the versioned vendor
    folders, which never change under their name and are cached for a year."""

    def file_response(
        self,
        full_path: PathLike,
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        relative = Path(full_path).relative_to(STATIC)
        immutable = relative.parts[:1] == ("vendor",)
        response.headers["Cache-Control"] = (
            "public, max-age=31536000, immutable" if immutable else "no-cache"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


static_files = Static(directory=STATIC)
