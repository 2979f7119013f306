"""The flags of ``queueserve gateway`` and ``queueserve dashboard``: one per field of their
options (queueserve/options/servers.py), its help the field's description, its default and its
variable. Here, not in gateway/: the CLI builds its parser without the gateway extra (uvicorn)
installed."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from queueserve.options.servers import SERVERS, ServerOptions
from queueserve.options.units import from_text

# Fields whose flag is not --<name>: repeatable ones, named for one value
FLAG_NAMES = {"models": "--model", "allow_origin": "--allow-origin"}
METAVARS = {"models": "MODEL=SERVING", "allow_origin": "ORIGIN", "tenants": "FILE"}


def flag_of(name: str) -> str:
    return FLAG_NAMES.get(name, f"--{name.replace('_', '-')}")


def _parser(model: type[ServerOptions], name: str) -> Callable[[str], object]:
    """A flag's value, checked as the model checks the field (argparse says what was wrong)."""
    annotation = model.model_fields[name].annotation

    def parse(text: str) -> object:
        try:
            value = from_text(name, annotation, text)
            return getattr(model.model_validate({name: value}), name)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e).splitlines()[-1]) from None

    parse.__name__ = name
    return parse


def add_server_options(p: argparse.ArgumentParser, model: type[ServerOptions]) -> None:
    """A flag per field of ``model``; one left out is None, so its variable or default
    applies (``ServerOptions.of``)."""
    for name, field in model.model_fields.items():
        default = field.default
        if default in (None, ()):
            shown = "none"
        elif isinstance(default, float):
            shown = f"{default:g}s"
        else:
            shown = str(default)
        more = f" (default {shown}; ${model.variable(name)})"
        if name in FLAG_NAMES:  # repeatable
            p.add_argument(
                flag_of(name),
                dest=name,
                action="append",
                metavar=METAVARS[name],
                help=f"{field.description}{more}",
            )
            continue
        p.add_argument(
            flag_of(name),
            dest=name,
            type=_parser(model, name),
            metavar=METAVARS.get(name, name.upper()),
            help=f"{field.description}{more}",
        )


def server_options(args: argparse.Namespace) -> ServerOptions | None:
    """The options of the server command ``args`` runs (its flags, then its variables, then
    the defaults); None for any other command. A ValueError says what was wrong."""
    model = SERVERS.get(args.command)
    if model is None:
        return None
    flags = {name: getattr(args, name, None) for name in model.model_fields}
    return model.of(flags, os.environ)
