"""Typed service configuration: defaults < config file < environment < command-line flags.

Each service declares one `ServiceConfig` subclass whose fields carry their documentation
(`Field(description=...)`). `Cls.load(argv)` resolves it:

- `--config FILE` (YAML, JSON or TOML) gives file values;
- environment variables `<ENV_PREFIX><FIELD>` (e.g. `HARNESSRL_STORE_REDIS_URL`) override them;
- flags `--field-name VALUE` override everything (`--flag` / `--no-flag` for booleans; lists
  and dicts as JSON).

The resolved config is logged at start-up (`describe()`), secrets masked.
"""

from __future__ import annotations

import argparse
import json
import logging
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Self, get_origin

import yaml
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
        for name, field in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            help_text = (field.description or "") + f" (default: {field.default!r})"
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
        values = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
        for name, value in list(values.items()):
            ann = cls.model_fields[name].annotation
            if isinstance(value, str) and get_origin(ann) in (list, dict, tuple):
                values[name] = json.loads(value)
        _FILE_VALUES.clear()
        if args.config:
            _FILE_VALUES.update(read_config_file(args.config))
        try:
            return cls(**values)
        finally:
            _FILE_VALUES.clear()

    @classmethod
    def for_service(cls, service: str, argv: list[str] | None = None) -> Self:
        """A service's start-up: resolves the config from file/env/flags, configures logging
        once for the process, and logs the resolved config (secrets masked)."""
        from harnessrl import log as hlog

        cfg = cls.load(argv, prog=f"python -m services.{service}")
        hlog.setup(service, getattr(cfg, "log_level", None))
        logging.getLogger(f"harnessrl.{service}").info("config %s", cfg.describe())
        return cfg

    def describe(self) -> str:
        data = self.model_dump(mode="json")
        for k in self.secret_fields:
            if data.get(k):
                data[k] = "***"
        return json.dumps(data, sort_keys=True)
