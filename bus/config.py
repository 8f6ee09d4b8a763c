"""One typed config per entry point, from CLI flags and ``JOYNEXUS_*`` environment variables.

Each service declares a pydantic model (extending :class:`BusConfig`); :func:`load_config`
derives ``--flag-name`` options and ``JOYNEXUS_FLAG_NAME`` variables from its fields. A
field that is itself a pydantic model (e.g. ``limit: InputLimits``) is flattened one level:
``--limit-max-image-side`` / ``JOYNEXUS_LIMIT_MAX_IMAGE_SIDE``.
Precedence: flag > environment > default. Unknown flags and invalid values exit with a
message naming the field and where its value came from.

The roles that load a backbone share :class:`BackboneConfig`; those that run tenants' heads
on its features (trainer, inferencer) share :class:`HeadsConfig`, whose check refuses a
cost table together with the backbone role at parse time.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from bus.datacache import DEFAULT_MAX_BYTES, DatasetCache, default_cache_root

ENV_PREFIX = "JOYNEXUS_"
C = TypeVar("C", bound=BaseModel)


class BusConfig(BaseModel):
    """Settings every role shares: where the bus is and how to authenticate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field("nats://127.0.0.1:4222", description="NATS server URL.")
    creds: str | None = Field(None, description="NATS .creds file (JWT + nkey).")
    user: str | None = Field(None, description="NATS user (plain auth).")
    password: str | None = Field(None, description="NATS password (plain auth).")
    tls_ca: str | None = Field(None, description="CA bundle; enables TLS.")
    instance: str | None = Field(None, description="Instance id (default: role-host-pid).")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Heartbeat period.")
    loop_stall_s: float = Field(
        300.0,
        ge=0,
        description="Exit 75 (for the supervisor to restart the role) when the event loop has "
        "not run for this long: a hung role, wherever it runs (0: never).",
    )
    replicas: int = Field(1, ge=1, le=5, description="Stream replicas when declaring.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads.")
    log_level: str = Field("INFO", description="Python logging level.")
    usage_report_s: float = Field(
        10.0, gt=0, description="How often a service reports its usage per tenant (USAGE)."
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on this port (0: none; needs "
        "opentelemetry-exporter-prometheus).",
    )
    metrics_host: str = Field("127.0.0.1", description="Address the metrics endpoint binds.")
    health_file: str | None = Field(
        None,
        description="Touch this file at each heartbeat the bus took (a container's health "
        "check reads its age: python -m bus.liveness FILE).",
    )
    trace_file: str | None = Field(
        None,
        description="Append this process's finished spans to this JSON-lines file "
        "(`joynexus trace` reads it; OTLP and console come from the OTEL_* variables).",
    )

    # Checked here, so that a mistake is the one-line "invalid configuration" naming the flag
    # rather than a traceback from deep in the start-up.
    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        levels = logging.getLevelNamesMapping()
        if value.upper() not in levels:
            raise ValueError(f"{value!r} is not one of {', '.join(levels)}")
        return value.upper()

    @field_validator("creds", "tls_ca")
    @classmethod
    def _a_file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{value!r} is not a file")
        return value


class DatasetsConfig(BusConfig):
    """A role that reads tenants' pushed datasets (master, env worker): where it materialises
    them and how much disk they may take (:mod:`bus.datacache`)."""

    dataset_cache: str = Field(
        "", description="Where pushed datasets are materialised (default: a temp dir)."
    )
    dataset_cache_max_bytes: int = Field(
        DEFAULT_MAX_BYTES,
        ge=0,
        description="Disk the materialised datasets may take: past it, the least recently used "
        "ones not used for an hour are removed (downloaded again when a job names them; "
        "0: no bound).",
    )

    def dataset_cache_settings(self) -> DatasetCache:
        root = Path(self.dataset_cache) if self.dataset_cache else default_cache_root()
        return DatasetCache(root, self.dataset_cache_max_bytes)


#: ``cost_table`` when no cost table splits grouped forwards (``vla.costmodel.OFF``).
COST_TABLE_OFF = "off"


class BackboneConfig(BusConfig):
    """The backbone a role loads."""

    backbone: str = Field("tiny", description="Checkpoint dir or tiny name to load.")
    backbone_id: str | None = Field(None, description="Subject id (default: derived).")
    device: str = Field("cpu", description="torch device.")
    dtype: str = Field("float32", description="Backbone dtype (bfloat16 on CUDA).")


class HeadsConfig(BackboneConfig):
    """A role that runs heads on the backbone's features: from its own resident backbone
    (whose grouped forwards a cost table may split) or from the backbone role."""

    cost_table: str = Field(
        COST_TABLE_OFF,
        description="Group-size cost table: 'off' (the default: never split a grouped forward; "
        "a table measured at start-up on a loaded machine split groups into pieces slower than "
        "serial), 'measure' (a few forwards at start-up), "
        "or a JSON file (read; measured and written if missing; "
        "a 'bench grouping --json' result works too).",
    )
    backbone_service: bool = Field(
        False,
        description="Take features from the backbone role (services.backbone) instead of a "
        "resident backbone: this process loads the backbone only to normalise inputs, then "
        "frees its weights and holds only heads.",
    )
    encode_timeout_s: float = Field(
        30.0, gt=0, description="With --backbone-service: wait this long for an encode answer."
    )

    @model_validator(mode="after")
    def _split_needs_a_resident_backbone(self) -> HeadsConfig:
        if self.backbone_service and self.cost_table != COST_TABLE_OFF:
            raise ValueError(
                "--cost-table splits a resident backbone's forwards; with "
                "--backbone-service the backbone role runs them (drop one of the two)"
            )
        return self


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return (
        get_origin(annotation) is not None
        and bool in get_args(annotation)
        and all(a in (bool, type(None)) for a in get_args(annotation))
    )


def _nested(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _options(cls: type[BaseModel]) -> list[tuple[str, str | None, Any]]:
    """(option name, parent field or None, pydantic field) of every flag of ``cls``."""
    options: list[tuple[str, str | None, Any]] = []
    for name, field in cls.model_fields.items():
        inner = _nested(field.annotation)
        if inner is None:
            options.append((name, None, field))
        else:
            options.extend((f"{name}_{sub}", name, f) for sub, f in inner.model_fields.items())
    return options


def build_parser(cls: type[BaseModel], prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    for name, _, field in _options(cls):
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or ''} [env {env_name(name)}]"
        if _is_bool(field.annotation):
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    return parser


def load_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> C:
    """Parse ``argv`` (default ``sys.argv[1:]``) and ``env`` (default ``os.environ``) into
    ``cls``; on invalid input print which field was wrong and exit 2."""
    env = os.environ if env is None else env
    parser = build_parser(cls, prog)
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, parent, _ in _options(cls):
        if args.get(name) is not None:
            value, source = args[name], "--" + name.replace("_", "-")
        elif env_name(name) in env:
            value, source = env[env_name(name)], env_name(name)
        else:
            continue
        if parent is None:
            values[name], sources[name] = value, source
        else:
            sub = name[len(parent) + 1 :]
            values.setdefault(parent, {})[sub] = value
            sources[f"{parent}.{sub}"] = source
    try:
        return cls.model_validate(values, strict=False)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"]:  # a check across fields: its message names them
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            field = ".".join(str(p) for p in err["loc"][:2]) if err["loc"] else "?"
            if field not in sources:
                field = str(err["loc"][0]) if err["loc"] else "?"
            problems.append(f"{sources.get(field, field)}: {err['msg']}")
        parser.exit(2, f"{parser.prog}: invalid configuration: {'; '.join(problems)}\n")
    raise AssertionError("unreachable")  # parser.exit raises SystemExit


def main_config(cls: type[C], prog: str) -> C:
    return load_config(cls, sys.argv[1:], prog=prog)
