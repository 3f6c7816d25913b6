"""A service's config file: a key no field has is refused with its name (and the nearest field),
not dropped, which would leave the field it meant at its default unseen; known keys, sections
included, still apply beneath the environment and the flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.store.config import StoreConfig
from services.trainer.config import TrainerConfig


def test_a_misspelt_key_in_a_config_file_is_refused_with_the_field_it_meant(
        tmp_path: Path) -> None:
    conf = tmp_path / "store.yaml"
    conf.write_text("redis-url: redis://127.0.0.1:1/0\nkey_prefx: x\n")
    with pytest.raises(ValueError, match=r"unknown key 'key_prefx' \(did you mean 'key_prefix'"):
        StoreConfig.load(["--config", str(conf)])
    conf.write_text("redis-url: redis://127.0.0.1:1/0\nkey-prefix: 'p:'\n")
    cfg = StoreConfig.load(["--config", str(conf)])
    assert (cfg.redis_url, cfg.key_prefix) == ("redis://127.0.0.1:1/0", "p:")


def test_unknown_keys_at_the_top_and_in_a_section_are_refused(tmp_path: Path) -> None:
    conf = tmp_path / "trainer.toml"
    conf.write_text("zzz = 1\nqqq = 2\n")
    with pytest.raises(ValueError, match="unknown keys 'zzz', 'qqq'"):
        TrainerConfig.load(["--config", str(conf)])
    conf.write_text("[optimizer]\nlrr = 0.5\n")
    with pytest.raises(ValueError, match="lrr"):
        TrainerConfig.load(["--config", str(conf)])
    conf.write_text("[optimizer]\nlr = 0.5\n")
    assert TrainerConfig.load(["--config", str(conf), "--optimizer.beta1", "0.7"]).optimizer.lr \
        == 0.5
