"""The key table (handler/config/keys.py) is the one declaration of every serving.properties key:
the README documents exactly its keys, its defaults are the config records' own, its env
aliases and spellings reach the key, and values keep their field's name up to the start-up log."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from engine import EngineConfig
from handler.config.key_policy import POLICY_KEYS
from handler.config.keys import BY_NAME, ENV_ALIASES, KEYS
from handler.config.lmi_options import LmiOptions
from handler.config.properties import collect_settings, env_settings, parse_properties
from handler.config.serving_config import ServingConfig, build_serving_config

README = Path(__file__).resolve().parent.parent / "README.md"
OWNERS = {"engine": EngineConfig, "lmi": LmiOptions, "": ServingConfig}
# The field's own default differs from the key's on purpose: EngineConfig's max_num_seqs=1 is
# the none strategy's; the key's 32 is what the rolling strategies run when it is unset.
OWN_DEFAULTS = {"engine.max_num_seqs"}


def readme_table_keys() -> list[str]:
    """The keys in the first column of the table in README.md's "## Configuration" section."""
    section = README.read_text().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0].startswith("| key |"), "the section's first table is the key table"
    table = rows[2:]
    return [key for row in table for key in re.findall(r"`([\w.]+)`", row.split("|")[1])]


def resolve(text: str = "") -> ServingConfig:
    return build_serving_config(parse_properties(text, "serving.properties"), Path("/m"),
                                ["LlamaForCausalLM"])


def test_the_readme_table_lists_exactly_the_tables_keys() -> None:
    documented = readme_table_keys()
    assert sorted(k for k in set(documented) if documented.count(k) > 1) == []
    assert sorted(documented) == sorted(key.name for key in KEYS)


def test_each_key_is_declared_once() -> None:
    names = [key.name for key in KEYS]
    assert len(names) == len(set(names)) == len(BY_NAME)


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_each_field_exists_and_defaults_as_the_key_does(key) -> None:
    for path in key.fields:
        owner, _, name = path.rpartition(".")
        fields = {f.name: f for f in dataclasses.fields(OWNERS[owner])}
        assert name in fields, f"{key.name}: no field {path}"
        if path not in OWN_DEFAULTS and fields[name].default is not dataclasses.MISSING:
            assert fields[name].default == key.default, f"{key.name}: {path}"


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_each_key_is_reached_by_its_spelling_and_its_env_variables(key) -> None:
    assert list(parse_properties(f"{key.name}=v", "f")) == [key.name]
    assert list(env_settings({key.env_var: "v"})) == [key.name]
    for alias in key.env:
        assert ENV_ALIASES[alias] == key.env_var
        assert env_settings({alias: "v"})[key.name].source == f"env {alias}"


def test_the_start_up_line_names_values_as_their_fields() -> None:
    line = resolve("option.rolling_batch=paged\noption.max_rolling_batch_prefill_tokens=64\n"
                   "option.max_rolling_batch_size=8").describe()
    assert "max_num_seqs=8" in line and "max_num_batched_tokens=64" in line
    assert "block_size=16" in line and "enable_chunked_prefill=True" in line
    assert "token_budget" not in line and "max_batch_delay_ms" not in line
    assert "max_batch_delay_ms=20" in resolve("batch_size=2\nmax_batch_delay=20").describe()


def test_the_custom_handlers_batching_lives_in_the_serving_config() -> None:
    cfg = resolve("batch_size=4\nmax_batch_delay=500")
    assert (cfg.lmi.batch_size, cfg.lmi.max_batch_delay_ms) == (4, 500.0)
    assert cfg.engine.max_num_seqs == 4  # the engine's dynamic strategy batches as many
    rolling = resolve("option.rolling_batch=scheduler\nmax_batch_delay=5")
    assert (rolling.lmi.batch_size, rolling.engine.max_num_seqs) == (1, 32)


def test_paged_attention_is_checked_whatever_the_strategy() -> None:
    with pytest.raises(ValueError, match="option.paged_attention='maybe'"):
        resolve("option.rolling_batch=vllm\noption.paged_attention=maybe")


def test_shipped_properties_use_only_declared_keys() -> None:
    folder = Path(__file__).resolve().parent.parent / "serving.properties.d"
    for path in sorted(folder.glob("*.properties")):
        unknown = set(collect_settings(path, {})) - set(BY_NAME) - POLICY_KEYS
        assert unknown == set(), path.name
