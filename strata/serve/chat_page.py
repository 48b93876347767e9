"""The chat page at `/`: three static files shipped in the package, served beside the API they call.

The page is public, as llama-server's is: a browser cannot attach a key to a
page load, and the page holds nothing of the server's. Every API call it makes
carries the key its user typed, so the API's key rules are unchanged. The
files are read once when the app is built (they are small) and sent with a
Content-Security-Policy that lets the page load and call nothing but this
server, so model output can never pull in a script.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
       "frame-ancestors 'none'; form-action 'none'")


@dataclass(frozen=True)
class PageFile:
    path: str  # the URL path it is served at
    name: str  # its file name in strata/serve/static/
    media_type: str


PAGE_FILES = (
    PageFile("/", "index.html", "text/html; charset=utf-8"),
    PageFile("/static/chat.js", "chat.js", "text/javascript; charset=utf-8"),
    PageFile("/static/chat.css", "chat.css", "text/css; charset=utf-8"),
)
PAGE_PATHS = frozenset(f.path for f in PAGE_FILES)


def read_page_file(name: str) -> bytes:
    """One of the page's files from the installed package."""
    return resources.files("strata.serve").joinpath("static", name).read_bytes()


def _file_route(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache"}  # a new server version's page replaces the old one

    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=headers)

    return serve_file


def chat_page_router() -> APIRouter:
    """GET routes for the page's files, their bytes read now."""
    router = APIRouter()
    for page in PAGE_FILES:
        router.add_api_route(page.path, _file_route(read_page_file(page.name), page.media_type),
                             methods=["GET"], include_in_schema=False)
    return router
