"""EngineConfig: the one value every caller builds an Engine from (generate, serve, the bench, a head's data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qspec.errors import ConfigError
from qspec.runtime.config import EngineConfig


def test_keywords_split_into_fields_and_proposer_knobs():
    """Engine(package, **knobs): the config's fields by name, any other knob goes to the proposer."""
    config = EngineConfig.of(method="suffix", num_speculative_tokens=[0, 4], suffix_decoding_max_tree_depth=8)
    assert config.num_speculative_tokens == (0, 4)
    assert config.proposer_knobs() == {"suffix_decoding_max_tree_depth": 8}


def test_typed_knobs_reach_the_proposer_only_when_given():
    """None means the proposer's default: it is not passed (make_proposer fills it)."""
    config = EngineConfig.create(method="draft", draft_package=Path("d"), prompt_lookup_min=None)
    assert config.proposer_knobs() == {"draft_package": Path("d")}
    assert EngineConfig.create(method="pld").proposer_knobs() == {}


def test_a_misspelt_field_is_a_one_line_error():
    with pytest.raises(ConfigError, match="max_batch_sise"):
        EngineConfig.create(max_batch_sise=2)


def test_an_engine_takes_a_config_or_its_fields_not_both(tmp_path):
    """Both at once would leave one silently unused."""
    from qspec.runtime.engine import Engine

    with pytest.raises(ConfigError, match="not both"):
        Engine(tmp_path, EngineConfig(), method="none")
