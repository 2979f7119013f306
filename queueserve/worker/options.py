"""The worker's options, declared once: ``qs.Worker(...)`` keywords, ``queueserve worker``
flags (built from these fields, their defaults and descriptions) and ``QUEUESERVE_<NAME>``
environment variables (docs/operations.md lists every one). A flag or keyword wins over the
environment, which wins over the default.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, SettingsError

from queueserve.options.servers import SERVERS, Level
from queueserve.options.serving_options import MAX_BATCH_SIZE, MAX_BATCH_TIMEOUT_S, validated
from queueserve.options.units import ByteSize, checked_by, count, duration, from_text
from queueserve.settings import Settings
from queueserve.worker.logs import LogFormat
from queueserve.worker.metrics_server import DEFAULT_HOST, KEY_LABELS
from queueserve.worker.supervisor import check_partitions

ENV_PREFIX = "QUEUESERVE_"
# Variables read elsewhere: the client's settings (queueserve.settings), the gateway's and the
# dashboard's options (options/servers.py), the test suite's Redis.
OTHER_VARIABLES = (
    *(f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields),
    *(model.variable(name) for model in SERVERS.values() for name in model.model_fields),
    "QUEUESERVE_TEST_REDIS_URL",
)


class WorkerOptions(BaseModel):
    """How a worker runs its servings; each field is a flag ``--<name>`` and a variable
    ``QUEUESERVE_<NAME>``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partitions: Annotated[int | str, checked_by(check_partitions)] = Field(
        "auto", description="'auto' (one per visible CUDA device, else 1) or a number"
    )
    batch_size: Annotated[int, count(1, MAX_BATCH_SIZE)] | None = Field(
        None, description="override every serving's batch_size"
    )
    batch_timeout: Annotated[float, duration(MAX_BATCH_TIMEOUT_S)] | None = Field(
        None, description="override every serving's batch_timeout, e.g. 10ms"
    )
    batch_keys: tuple[str, ...] = Field(
        (),
        description="batch keys to consume from the start (flag repeatable; variable "
        "comma-separated); others are found",
    )
    max_concurrent_batches: Annotated[int, count(1)] = Field(
        1,
        description="batches a partition executes at once (one more is read and "
        "decoded ahead meanwhile)",
    )
    shutdown_timeout: Annotated[float, duration()] = Field(
        30.0, description="how long SIGTERM may take to finish held work"
    )
    max_restarts: Annotated[int, count(1)] = Field(
        5, description="partition deaths tolerated within restart_window"
    )
    restart_window: Annotated[float, duration()] = Field(
        60.0, description="window for max_restarts"
    )
    max_batch_seconds: Annotated[float, duration()] | None = Field(
        None,
        description="abandon a batch running longer: its partition is restarted and "
        "its requests retried under max_deliveries",
    )
    max_batches_per_partition: Annotated[int, count(1)] | None = Field(
        None, description="recycle a partition (drain, restart) after this many batches"
    )
    torch_threads: Annotated[int, count(1)] | None = Field(
        None,
        description="torch threads per partition on the CPU (default: the cores divided "
        "among the partitions)",
    )
    max_partition_memory: ByteSize | None = Field(
        None, description="recycle a partition whose resident memory passes this, e.g. 4GiB"
    )
    metrics_port: Annotated[int, count(0, 65535)] | None = Field(
        None, description="serve Prometheus /metrics, /healthz and /readyz on this port"
    )
    metrics_host: str = Field(
        DEFAULT_HOST,
        description="address the metrics port listens on (0.0.0.0 to be scraped "
        "from other hosts or containers)",
    )
    metrics_keys: Annotated[
        int,
        count(
            0,
            says=">= 0 (batch keys with a metrics label of "
            'their own; the rest are summed under key="other")',
        ),
    ] = Field(
        KEY_LABELS,
        description="batch keys labelled by name in metrics besides declared "
        'ones, the deepest first; the rest are summed under key="other"',
    )

    log_format: LogFormat = Field(
        "text",
        description="text, or json: one JSON object a line with partition, batch_id and "
        "request_ids (the logs extra)",
    )
    log_level: Level = Field(
        "INFO", description="DEBUG, INFO, WARNING or ERROR: what the worker's log says"
    )

    @classmethod
    def of(
        cls, given: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> WorkerOptions:
        """The options ``given`` (keywords, flags), each other one from its ``QUEUESERVE_*``
        variable in ``environ`` (default os.environ) or its default; a ValueError (a
        TypeError for a value of the wrong type) saying what was wrong."""
        env = _from_environment(os.environ if environ is None else environ)
        return validated(cls, {**env, **given})


def option_from_text(name: str, text: str) -> Any:
    """Option ``name`` written as ``text`` (a flag, a variable), checked."""
    value = from_text(name, WorkerOptions.model_fields[name].annotation, text)
    return getattr(validated(WorkerOptions, {name: value}), name)


class _TextSource(EnvSettingsSource):
    """Environment variables as text, turned into values by the field's type (from_text) and
    checked by the model afterwards, with the variable named in what was wrong."""

    def prepare_field_value(
        self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool
    ) -> Any:
        if value is None:
            return None
        variable = f"{ENV_PREFIX}{field_name.upper()}"
        try:
            return option_from_text(field_name, value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{variable}={value!r:.60}: {e}") from None


def _from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The worker options set by ``QUEUESERVE_*`` variables in ``environ``, read by
    pydantic-settings; checked with the rest in WorkerOptions.of."""
    source = _TextSource(WorkerOptions, case_sensitive=False, env_prefix=ENV_PREFIX)  # type: ignore[arg-type]
    source.env_vars = {k.lower(): v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    try:
        return source()
    except SettingsError as e:  # its own words only name the field; the cause says why
        raise e.__cause__ or e from None


def unknown_variables(environ: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(misspelled, unknown): a ``QUEUESERVE_*`` variable close to an option's name is
    misspelled (said with the name meant); one that is not is only unknown (another
    program's, or a newer queueserve's)."""
    known = [*(f"{ENV_PREFIX}{n.upper()}" for n in WorkerOptions.model_fields), *OTHER_VARIABLES]
    misspelled, unknown = [], []
    for name in sorted(os.environ if environ is None else environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        meant = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if meant:
            misspelled.append(
                f"{name} is not a queueserve variable: did you mean {meant[0]}? "
                "(docs/operations.md lists every QUEUESERVE_* variable)"
            )
        else:
            unknown.append(name)
    return misspelled, unknown
