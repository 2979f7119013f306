"""Finding servings by ``module:attr``, the way the CLI and partition processes name them."""

from __future__ import annotations

import difflib
import importlib
import os
import traceback
from pathlib import Path
from types import ModuleType

from queueserve.errors import QueueServeError
from queueserve.serving import Serving

_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # queueserve/, with the separator


class ServingNotFound(QueueServeError):
    """A ``module:attr`` that does not name a serving; the message says what was wrong."""


def load_servings(spec: str) -> list[Serving]:
    """Servings named by ``module:attr``: a Serving, a Serving subclass, or a list of them."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ServingNotFound(f"{spec!r} is not module:attr (for example myapp.servings:embed)")
    if "/" in module_name or "\\" in module_name:  # a path: no module's name holds one
        raise ServingNotFound(_path_hint(spec, module_name, attr))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        named_a_file = module_name.endswith(".py") and e.name == module_name
        hint = _path_hint(spec, module_name, attr) if named_a_file else ""
        raise ServingNotFound(
            hint
            or f"cannot import module {module_name!r} for {spec!r}: {e}"
            f"{_where_hint(module_name, e)}"
        ) from None
    except Exception as e:  # a SyntaxError, or the module's own code raised: one line, exit 2
        raise ServingNotFound(
            f"cannot import module {module_name!r} for {spec!r}: {_raised_at(e)}"
        ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ServingNotFound(
            f"module {module_name!r} has no attribute {attr!r}{_suggest(module, attr)}"
        ) from None
    if isinstance(obj, type) and issubclass(obj, Serving):
        try:
            obj = obj()
        except Exception as e:  # an option the class sets is refused, say: one line, exit 2
            raise ServingNotFound(f"cannot make serving {spec!r}: {_raised_at(e)}") from None
    found = obj if isinstance(obj, list | tuple) else [obj]
    if not found or not all(isinstance(s, Serving) for s in found):
        raise ServingNotFound(
            f"{spec} is {type(obj).__name__}, not a qs.Serving (or a subclass, or a list of them)"
        )
    return list(found)


def _raised_at(e: Exception) -> str:
    """What a failing import raised, with where: the offending line of a SyntaxError, else the
    innermost frame of the traceback outside queueserve (the user's line that called into it:
    a ``qs.Serving(...)`` refusing an option raises from pydantic's frames), said once."""
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    theirs = [f for f in frames if not f.filename.startswith(_PACKAGE)]
    frame = theirs[-1] if theirs else None  # None: loading.py called queueserve's own code
    said = f"{type(e).__name__}: {e}"
    if frame is None or f"{frame.filename}, line {frame.lineno}" in said:
        return said
    return f"{said} ({frame.filename}, line {frame.lineno})"


def _suggest(module: ModuleType, attr: str) -> str:
    """The servings of ``module`` whose names are close to ``attr`` (difflib), else all of
    them, for the message of a misspelled attribute."""
    servings = sorted(name for name, value in vars(module).items() if _is_servings(value))
    where = module.__name__
    close = difflib.get_close_matches(attr, servings, n=3)
    if close:
        return "; did you mean " + " or ".join(f"{where}:{name}" for name in close) + "?"
    if servings:
        return f"; its servings: {', '.join(f'{where}:{name}' for name in servings)}"
    return "; it defines no qs.Serving"


def _is_servings(value: object) -> bool:
    """What ``module:attr`` may name: a Serving, a Serving subclass of the user's, or a
    non-empty list or tuple of Servings."""
    if isinstance(value, type):
        return issubclass(value, Serving) and not value.__module__.startswith("queueserve")
    if isinstance(value, list | tuple):
        return bool(value) and all(isinstance(v, Serving) for v in value)
    return isinstance(value, Serving)


def _path_hint(spec: str, module_name: str, attr: str) -> str:
    """The message for a file path given where a module's name goes (``myapp/servings.py``):
    the dotted name Python imports it by, and the folder to run the command from."""
    cwd = os.getcwd()
    path = Path(os.path.normpath(os.path.join(cwd, module_name.removesuffix(".py"))))
    try:
        parts = list(path.relative_to(cwd).parts)
    except ValueError:  # outside the current folder: named from its own
        parts, cwd = [path.name], str(path.parent)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    holds = f"{parts[0]}/" if len(parts) > 1 else f"{parts[0]}.py"
    return (
        f"{spec!r} names a file, not a module: name the module with dots, as Python imports "
        f"it: {'.'.join(parts)}:{attr} (run from {cwd}, the folder that holds {holds})"
    )


def _where_hint(module_name: str, error: ImportError) -> str:
    """Where to put the module, when it is the spec's own package that is missing (not one it
    imports: that is a missing dependency, and its message says so already)."""
    top = module_name.split(".")[0]
    if getattr(error, "name", None) != top:
        return ""
    return (
        f" (searched the current directory {os.getcwd()} and PYTHONPATH: run the command from "
        f"the folder that holds {top}/ or {top}.py, or add that folder to PYTHONPATH)"
    )
