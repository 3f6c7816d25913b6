"""Typed service configuration: defaults < config file < environment < command-line flags.

Each service declares one `ServiceConfig` subclass whose fields carry their documentation
(`Field(description=...)`). `Cls.load(argv)` resolves it:

- `--config FILE` (YAML, JSON or TOML) gives file values;
- environment variables `<ENV_PREFIX><FIELD>` (e.g. `HARNESSRL_STORE_REDIS_URL`) override them;
- flags `--field-name VALUE` override everything (`--flag` / `--no-flag` for booleans; lists
  and dicts as JSON).

A field may be a section (a nested pydantic model): in a file it is a mapping, in the
environment `<ENV_PREFIX><SECTION>__<FIELD>` (where the service sets `env_nested_delimiter`),
on the command line `--section.field VALUE` (or `--section JSON`).

The resolved config is logged at start-up (`describe()`), secrets masked.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Self, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

_FILE_VALUES: dict[str, Any] = {}


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return _FILE_VALUES.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in _FILE_VALUES.items() if k in self.settings_cls.model_fields}


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        data = yaml.safe_load(text) or {}
    elif p.suffix == ".toml":
        data = tomllib.loads(text)
    elif p.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"config file {p}: unknown format (use .yaml, .toml or .json)")
    if not isinstance(data, dict):
        raise ValueError(f"config file {p}: top level must be a mapping")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _section(field: FieldInfo) -> type[BaseModel] | None:
    """The section's model (also of an optional section, `Section | None`: off by default)."""
    ann = next((a for a in get_args(field.annotation) if a is not type(None)), field.annotation)
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _flat_fields(cls: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """Every field, and every field of a section (a nested model) as `section.field`."""
    out: list[tuple[str, FieldInfo]] = []
    for name, field in cls.model_fields.items():
        out.append((name, field))
        section = _section(field)
        if section is not None:
            out += [(f"{name}.{sub}", f) for sub, f in section.model_fields.items()]
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _known_keys(cls: type[BaseModel], path: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data`, or a ValueError naming each key no field of `cls` has (a misspelt key would
    otherwise leave its field at the default, unseen)."""
    unknown = [k for k in data if k not in cls.model_fields]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, list(cls.model_fields), n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"config file {path}: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(hints)}; the keys are the fields of "
                         f"`{cls.__name__}` (`--help` lists them)")
    return data


class ServiceConfig(BaseSettings):
    """Base of every service's config. Subclasses set `env_prefix` in `model_config`."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)
    secret_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init kwargs carry the command-line flags: they win, then env, then the file.
        return (init_settings, env_settings, _FileSource(settings_cls))

    @classmethod
    def arg_parser(cls, prog: str | None = None) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
        parser.add_argument("--config", help="YAML, TOML or JSON file with config values")
        for name, field in _flat_fields(cls):
            flag = "--" + name.replace("_", "-")
            default = field.default if field.default_factory is None else "(section)"
            help_text = (field.description or "") + f" (default: {default!r})"
            if field.annotation is bool:
                parser.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                    help=help_text,
                )
            else:
                parser.add_argument(flag, dest=name, default=None, help=help_text)
        return parser

    @classmethod
    def load(cls, argv: list[str] | None = None, prog: str | None = None) -> Self:
        args = cls.arg_parser(prog).parse_args(argv)
        flat = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
        fields = dict(_flat_fields(cls))
        values: dict[str, Any] = {}
        for name, value in flat.items():
            field = fields[name]
            if isinstance(value, str) and (get_origin(field.annotation) in (list, dict, tuple)
                                           or _section(field) is not None):
                value = _json_or_text(value)
            head, _, rest = name.partition(".")
            if rest:  # a section's field: --section.field VALUE
                section = values.setdefault(head, {})
                if not isinstance(section, dict):
                    raise ValueError(f"--{head} and --{name.replace('_', '-')}: give the "
                                     f"section whole or field by field, not both")
                section[rest] = value
            elif head in values:
                raise ValueError(f"--{head} and --{head}.<field>: give the section whole or "
                                 f"field by field, not both")
            else:
                values[head] = value
        _FILE_VALUES.clear()
        if args.config:
            _FILE_VALUES.update(_known_keys(cls, args.config, read_config_file(args.config)))
        try:
            return cls(**values)
        finally:
            _FILE_VALUES.clear()

    @classmethod
    def for_service(cls, service: str, argv: list[str] | None = None) -> Self:
        """A service's start-up: resolves the config from file/env/flags, configures logging
        once for the process, and logs the resolved config (secrets masked)."""
        from harnessrl import log as hlog

        from harnessrl import identity

        cfg = cls.load(argv, prog=f"python -m services.{service}")
        try:  # before any other work: a service without an identity says so in one line
            identity.resolve()
        except identity.NoIdentity as exc:
            raise SystemExit(f"{service}: {exc}") from None
        hlog.setup(service, getattr(cfg, "log_level", None))
        logging.getLogger(f"harnessrl.{service}").info("config %s", cfg.describe())
        return cfg

    def describe(self) -> str:
        data = self.model_dump(mode="json")
        for k in self.secret_fields:
            if data.get(k):
                data[k] = "***"
        return mask_passwords(json.dumps(data, sort_keys=True))


_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@\"']*:)[^\s/@\"']+@")


def mask_passwords(text: str) -> str:
    """`text` with the password of every URL in it (`scheme://user:PASSWORD@host`) masked."""
    return _URL_PASSWORD.sub(r"\1***@", text)
