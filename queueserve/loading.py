"""Finding servings by ``module:attr``, the way the CLI and partition processes name them."""

from __future__ import annotations

import importlib

from .serving import Serving


class ServingNotFound(Exception):
    """A ``module:attr`` that does not name a serving; the message says what was wrong."""


def load_servings(spec: str) -> list[Serving]:
    """Servings named by ``module:attr``: a Serving, a Serving subclass, or a list of them."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ServingNotFound(f"{spec!r} is not module:attr (for example myapp.servings:embed)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ServingNotFound(f"cannot import module {module_name!r} for {spec!r}: {e}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ServingNotFound(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, Serving):
        obj = obj()
    found = obj if isinstance(obj, list | tuple) else [obj]
    if not found or not all(isinstance(s, Serving) for s in found):
        raise ServingNotFound(
            f"{spec} is {type(obj).__name__}, not a qs.Serving (or a subclass, or a list of them)"
        )
    return list(found)
