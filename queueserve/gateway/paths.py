"""The path a request names below the gateway's mount point: what its routes are matched on.

ASGI servers and mounting apps keep the whole path in ``scope["path"]`` and the mount point in
``scope["root_path"]`` (a Starlette ``Mount("/qs", app)``, or ``uvicorn --root-path``). The
router strips it; so must everything that looks at the path before the router does (the
token's open paths, the metrics' route labels, the dispatch route ahead of the stack), or a
mounted gateway asks for the token on ``/healthz`` and labels every route ``other``.
``route_path`` does what Starlette's private ``starlette._utils.get_route_path`` does (not its
API to import): follow it when Starlette changes how it matches mounted paths.
"""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """``scope``'s path less its ``root_path``, as Starlette's router matches it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if len(path) == len(root):
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path
