"""Every public exception queueserve defines derives from ``QueueServeError`` (a caller who
catches the root catches them all), and errors.py's drawn tree names each one."""

from __future__ import annotations

import importlib
import inspect

import queueserve.errors
from tests.support.helpers import REPO
from tests.unit.test_layout import module_files


def public_exceptions() -> dict[str, type[BaseException]]:
    """Exception classes defined (not imported) in queueserve's modules, by name, but for
    private ones (a leading underscore) and the HTTP servers' (errors of their own API, door/)."""
    found: dict[str, type[BaseException]] = {}
    for name in module_files(REPO, "queueserve"):
        if name.startswith(("queueserve.gateway", "queueserve.door")) or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attr.startswith("_")
            ):
                found[attr] = value
    return found


def test_every_public_exception_is_under_the_root() -> None:
    escaped = sorted(
        name
        for name, cls in public_exceptions().items()
        if not issubclass(cls, queueserve.errors.QueueServeError)
    )
    assert not escaped, f"derive these from queueserve.errors.QueueServeError: {escaped}"


def test_the_drawn_tree_names_every_public_exception() -> None:
    tree = queueserve.errors.__doc__ or ""
    drawn = {line.split("── ")[-1].split()[0] for line in tree.splitlines() if "── " in line}
    missing = sorted(set(public_exceptions()) - drawn - {"QueueServeError"})
    assert not missing, f"add these to the tree in queueserve/errors.py's docstring: {missing}"
