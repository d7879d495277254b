"""Tests of qspec.specializations: K parsing, config rules, the builder, the wire format."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from qspec.errors import ConfigError
from qspec.spec_file import read_specializations, specializations_to_json, write_specializations
from qspec.specializations import (
    Specialization,
    SpecializationConfig,
    build_specializations,
    check_model_speculative_config,
    make_config,
    model_speculative_length,
    parse_num_speculative_tokens,
)

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "specializations" / "schema.json").read_text())
GOLDEN = ROOT / "specializations" / "golden"

# Compute-context-length buckets x K: unsorted, duplicated, ctx_len not listed (it is added).
CCL_CASE = {
    "num_speculative_tokens": "4,0",
    "ctx_len": 1024,
    "comp_ctx_lengths_prefill": "256",
    "comp_ctx_lengths_decode": "512,256,256",
}
# Golden file -> (config options, format).
GOLDEN_CASES = {
    "bs1_prefill32_ctx128_k0_4.json": ({"num_speculative_tokens": "0,4"}, "flat"),
    "unsorted_duplicates.json": ({"num_speculative_tokens": "4,0,4,1"}, "flat"),
    "continuous_batching_fbs4.json": (
        {"num_speculative_tokens": "0,4", "full_batch_size": 4, "ctx_len": 256},
        "flat",
    ),
    "named_k0_4.json": ({"num_speculative_tokens": "0,4"}, "named"),
    "non_speculative.json": ({"num_speculative_tokens": 0, "speculative": False}, "flat"),
    "ccl_k0_4.json": (CCL_CASE, "flat"),
    "ccl_named_k0_4.json": (CCL_CASE, "named"),
}


def shapes(specs: list[Specialization]) -> list[tuple]:
    """(batch_size, seq_len, ctx_len, num_logits_to_keep, full_batch_size) of each spec."""
    return [(s.batch_size, s.seq_len, s.ctx_len, s.num_logits_to_keep, s.full_batch_size) for s in specs]


def entries(*items: str) -> str:
    """A specializations file holding the JSON ``items``."""
    return '{"specializations": [' + ", ".join(items) + "]}"


def config_error(**kwargs) -> str:
    """The message of the ConfigError that make_config raises for ``kwargs``."""
    with pytest.raises(ConfigError) as info:
        make_config(**kwargs)
    return str(info.value)


# --- parse_num_speculative_tokens ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0,4", (0, 4)),
        ("4,0,4", (0, 4)),  # sorted, duplicates removed
        (" 4 , 1 ", (1, 4)),  # spaces around entries are fine
        (4, (4,)),  # an int is one K
        (0, (0,)),
        ([4, 0], (0, 4)),
        ((2, 2, 1), (1, 2)),
    ],
)
def test_parse_k_sorts_and_deduplicates(value, expected):
    """Every accepted spelling of the K list gives the sorted, distinct Ks."""
    assert parse_num_speculative_tokens(value) == expected


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ("0,a", ["'0,a'", "'a' is not an integer", "such as 0,4"]),
        ("4,,", ["'4,,'", "empty entry", "such as 0,4"]),
        ("", ["''", "empty", "such as 0,4"]),
        ("  ", ["empty"]),
        ([], ["[]", "empty"]),
        ("0,-1", ["'0,-1'", "K=-1 is negative"]),
        (-2, ["-2", "K=-2 is negative"]),
        ([0, True], ["True is not an integer"]),
        (1.5, ["1.5", "neither an integer nor a list"]),
    ],
)
def test_parse_k_errors_name_the_value_and_the_fix(value, fragments):
    """Bad K lists raise ConfigError naming the bad value and the expected spelling."""
    with pytest.raises(ConfigError) as info:
        parse_num_speculative_tokens(value)
    for fragment in fragments:
        assert fragment in str(info.value)


# --- SpecializationConfig ----------------------------------------------------------------


def test_config_accepts_int_and_string_ks():
    """An int or a comma-separated string both become a sorted tuple on the config."""
    assert make_config(num_speculative_tokens=4).num_speculative_tokens == (4,)
    assert make_config(num_speculative_tokens="4,0").num_speculative_tokens == (0, 4)


def test_config_defaults():
    """Defaults: prefill 32, ctx 128, batch 1, no continuous batching, speculative graph."""
    config = make_config(num_speculative_tokens="0,4")
    assert (config.prefill_seq_len, config.ctx_len, config.batch_size) == (32, 128, 1)
    assert config.full_batch_size is None and config.speculative
    assert not config.continuous_batching


def test_config_is_frozen():
    """A config cannot be changed after validation."""
    config = make_config(num_speculative_tokens=0)
    with pytest.raises(ValidationError):
        config.ctx_len = 4  # type: ignore[misc]


def test_k_too_large_for_ctx_len_names_both_values():
    """K=200 needs seq_len 201, which does not fit ctx_len 128."""
    message = config_error(num_speculative_tokens=200)
    assert message == ("num_speculative_tokens 200 needs seq_len 201 > ctx_len 128; lower K or raise ctx_len")


def test_k_filling_ctx_len_exactly_is_allowed():
    """K=127 gives seq_len 128 == ctx_len 128: allowed."""
    assert make_config(num_speculative_tokens=127).num_speculative_tokens == (127,)


def test_prefill_longer_than_ctx_len_names_both_values():
    """prefill_seq_len 256 does not fit ctx_len 128."""
    message = config_error(num_speculative_tokens=0, prefill_seq_len=256)
    assert "prefill_seq_len 256 > ctx_len 128" in message
    assert "raise ctx_len" in message


def test_full_batch_size_smaller_than_batch_size_names_both_values():
    """full_batch_size 2 cannot hold a prefill of batch_size 4."""
    message = config_error(num_speculative_tokens=0, batch_size=4, full_batch_size=2)
    assert "full_batch_size 2 < batch_size 4" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("batch_size", 0), ("ctx_len", 0), ("prefill_seq_len", -1), ("full_batch_size", 0)],
)
def test_non_positive_sizes_name_field_and_value(field, value):
    """A size below 1 is refused with a one-line message naming the field and value."""
    message = config_error(num_speculative_tokens=0, **{field: value})
    assert message.startswith(f"{field}={value}:")
    assert "greater than or equal to 1" in message
    assert "\n" not in message


def test_bad_k_message_reaches_config_error_unchanged():
    """The parser's message is the config's message, without pydantic decoration."""
    message = config_error(num_speculative_tokens="0,a")
    assert message == ("num_speculative_tokens '0,a': 'a' is not an integer; give a comma-separated list such as 0,4")


def test_unknown_option_is_refused():
    """extra='forbid': a typo in an option name is an error, not silently ignored."""
    assert config_error(num_speculative_tokens=0, ctx_length=64) == "unknown option ctx_length=64"


def test_comp_ctx_lengths_buckets_times_ks():
    """One prefill per prefill bucket, one decode per (decode bucket, K); sorted, deduplicated, ctx_len added."""
    specs = build_specializations(make_config(**CCL_CASE))
    assert [(s.seq_len, s.comp_ctx_lengths) for s in specs] == [
        (32, 256),
        (32, 1024),  # prefill buckets: 256 given, 1024 = ctx_len added
        (1, 256),
        (5, 256),
        (1, 512),
        (5, 512),
        (1, 1024),
        (5, 1024),  # decode: bucket-major, K ascending
    ]
    names = json.loads(specializations_to_json(specs, fmt="named"))["specializations"]
    assert [n["name"] for n in names][:3] == ["Prefill_0", "Prefill_1", "Decode_0"]  # QEfficient's positional names


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"comp_ctx_lengths_decode": "2048"}, "comp_ctx_lengths_decode 2048 > ctx_len 1024"),
        ({"comp_ctx_lengths_decode": "4"}, "comp_ctx_lengths_decode 4 < K=4 (seq_len) 5"),
        ({"comp_ctx_lengths_prefill": "16"}, "comp_ctx_lengths_prefill 16 < prefill_seq_len 32"),
        ({"comp_ctx_lengths_decode": "256,x"}, "comp_ctx_lengths_decode '256,x': 'x' is not an integer"),
        ({"comp_ctx_lengths_prefill": "0"}, "comp_ctx_lengths_prefill '0': 0 is below 1"),
    ],
)
def test_comp_ctx_lengths_validation(options, expected):
    """A bucket above ctx_len, too small for the largest K or the prefill chunk, or not a count: one line."""
    message = config_error(num_speculative_tokens="0,4", ctx_len=1024, **options)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_non_speculative_graph_allows_only_k0():
    """Without num_logits_to_keep the graph returns one logit: only K=0 makes sense."""
    message = config_error(num_speculative_tokens="0,4", speculative=False)
    assert "num_speculative_tokens [0, 4] needs a speculative graph" in message


def test_create_is_make_config():
    """SpecializationConfig.create converts validation errors exactly like make_config."""
    with pytest.raises(ConfigError, match="batch_size=0"):
        SpecializationConfig.create(num_speculative_tokens=0, batch_size=0)


# --- build_specializations ---------------------------------------------------------------


def test_build_prefill_then_one_decode_per_k():
    """K "4,0" over prefill 32 / ctx 128 gives prefill(32), decode(1), decode(5)."""
    specs = build_specializations(make_config(num_speculative_tokens="4,0"))
    assert shapes(specs) == [
        (1, 32, 128, 1, None),  # prefill: logits of the last real token only
        (1, 1, 128, 1, None),  # K=0
        (1, 5, 128, 5, None),  # K=4: seq_len = num_logits_to_keep = K + 1
    ]
    assert [s.num_speculative_tokens for s in specs[1:]] == [0, 4]


def test_build_continuous_batching_shapes():
    """FBS=4: prefill keeps batch_size 1, decode runs batch_size 4; both carry FBS 4."""
    config = make_config(num_speculative_tokens="0,4", full_batch_size=4, ctx_len=256)
    assert shapes(build_specializations(config)) == [
        (1, 32, 256, 1, 4),
        (4, 1, 256, 1, 4),
        (4, 5, 256, 5, 4),
    ]


def test_build_non_speculative_has_no_num_logits_to_keep():
    """A non-speculative graph has no num_logits_to_keep key at all."""
    config = make_config(num_speculative_tokens=0, speculative=False)
    assert shapes(build_specializations(config)) == [
        (1, 32, 128, None, None),
        (1, 1, 128, None, None),
    ]


def test_build_drops_decode_identical_to_prefill():
    """prefill_seq_len 1 and K=0 are the same shape key for key: only one is emitted."""
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=1)
    assert shapes(build_specializations(config)) == [(1, 1, 128, 1, None), (1, 5, 128, 5, None)]


def test_build_keeps_decode_differing_only_in_num_logits_to_keep():
    """prefill_seq_len 2 and K=1 share seq_len 2, but keep 1 vs 2 logits: both are kept."""
    config = make_config(num_speculative_tokens=1, prefill_seq_len=2)
    assert shapes(build_specializations(config)) == [(1, 2, 128, 1, None), (1, 2, 128, 2, None)]


def test_build_prefill1_k1_keeps_both():
    """prefill_seq_len 1 with K=[1]: seq_len 1 vs 2, nothing is dropped."""
    config = make_config(num_speculative_tokens=1, prefill_seq_len=1)
    assert shapes(build_specializations(config)) == [(1, 1, 128, 1, None), (1, 2, 128, 2, None)]


def test_build_cb_keeps_decode_that_differs_in_batch_size():
    """With FBS 4, prefill(1 token, batch 1) and K=0 (batch 4) differ: both are kept."""
    config = make_config(num_speculative_tokens=0, prefill_seq_len=1, full_batch_size=4)
    assert shapes(build_specializations(config)) == [(1, 1, 128, 1, 4), (4, 1, 128, 1, 4)]


def test_build_non_speculative_prefill1_collapses_to_one():
    """Non-speculative, prefill_seq_len 1, K=0: a single specialization serves both."""
    config = make_config(num_speculative_tokens=0, speculative=False, prefill_seq_len=1)
    assert shapes(build_specializations(config)) == [(1, 1, 128, None, None)]


# --- Specialization and the wire format ---------------------------------------------------


def test_to_wire_is_flat_ordered_strings_without_none():
    """to_wire: string values, contract key order, absent keys omitted."""
    spec = Specialization(batch_size=4, seq_len=5, ctx_len=256, num_logits_to_keep=5, full_batch_size=4)
    wire = spec.to_wire()
    assert list(wire) == [
        "batch_size",
        "seq_len",
        "ctx_len",
        "num_logits_to_keep",
        "full_batch_size",
    ]
    assert wire == {
        "batch_size": "4",
        "seq_len": "5",
        "ctx_len": "256",
        "num_logits_to_keep": "5",
        "full_batch_size": "4",
    }
    assert Specialization(batch_size=1, seq_len=1, ctx_len=8).to_wire() == {
        "batch_size": "1",
        "seq_len": "1",
        "ctx_len": "8",
    }


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"batch_size": 1, "seq_len": 9, "ctx_len": 8}, "seq_len 9 > ctx_len 8"),
        (
            {"batch_size": 1, "seq_len": 1, "ctx_len": 8, "num_logits_to_keep": 2},
            "num_logits_to_keep 2 > seq_len 1",
        ),
        (
            {"batch_size": 4, "seq_len": 1, "ctx_len": 8, "full_batch_size": 2},
            "full_batch_size 2 < batch_size 4",
        ),
    ],
)
def test_specialization_refuses_impossible_shapes(kwargs, fragment):
    """A shape that cannot be run is refused, naming both values."""
    with pytest.raises(ValueError, match=fragment):
        Specialization(**kwargs)


def test_flat_json_has_only_string_values():
    """The flat file holds strings only: integers make older compilers exit 255."""
    text = specializations_to_json(build_specializations(make_config(num_speculative_tokens="0,4")))
    entries = json.loads(text)["specializations"]
    assert all(isinstance(v, str) for entry in entries for v in entry.values())
    assert text.endswith("}\n")


def test_named_json_names_prefill_and_decode_as_qefficient():
    """Named form, QEfficient's names: Prefill, then Decode_0, Decode_1 (positional when repeated)."""
    text = specializations_to_json(build_specializations(make_config(num_speculative_tokens="0,4")), fmt="named")
    entries = json.loads(text)["specializations"]
    assert [e["name"] for e in entries] == ["Prefill", "Decode_0", "Decode_1"]
    assert entries[2]["symbols"] == {
        "batch_size": "1",
        "seq_len": "5",
        "ctx_len": "128",
        "num_logits_to_keep": "5",
    }


def test_unknown_format_is_refused():
    """Only 'flat' and 'named' exist."""
    with pytest.raises(ConfigError, match="'yaml'"):
        specializations_to_json([], fmt="yaml")  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["flat", "named"])
def test_round_trip_write_read(tmp_path, fmt):
    """read(write(x)) == x for both formats, continuous batching included."""
    specs = build_specializations(make_config(num_speculative_tokens="0,2,4", full_batch_size=4, ctx_len=256))
    path = write_specializations(specs, tmp_path / "specializations.json", fmt=fmt)
    assert read_specializations(path) == specs
    assert read_specializations(str(path)) == specs
    assert read_specializations(path.read_text()) == specs  # JSON text works too
    assert [p.name for p in tmp_path.iterdir()] == ["specializations.json"]  # no temp file left


def test_write_replaces_existing_file(tmp_path):
    """Writing over an existing file replaces it whole."""
    path = tmp_path / "s.json"
    path.write_text("old content that is longer than nothing" * 100)
    specs = build_specializations(make_config(num_speculative_tokens=0))
    write_specializations(specs, path)
    assert read_specializations(path) == specs


def test_read_accepts_integer_values():
    """Hand-written files with integer values are read too (the writer never makes them)."""
    text = '{"specializations": [{"batch_size": 1, "seq_len": 32, "ctx_len": 128}]}'
    assert shapes(read_specializations(text)) == [(1, 32, 128, None, None)]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("not json", "not valid JSON"),
        ("[]", 'expected {"specializations": [...]}'),
        ('{"specializations": []}', "list is empty"),
        (entries("1"), "entry 0: is int"),
        (entries('{"batch_size": "1", "seq_len": "x", "ctx_len": "8"}'), "entry 0: seq_len='x'"),
        (
            entries('{"batch_size": "1", "seq_len": "1", "ctx_len": "8", "foo": "1"}'),
            "unknown option foo",
        ),
        (
            entries('{"batch_size": true, "seq_len": "1", "ctx_len": "8"}'),
            "batch_size=True is not an integer",
        ),
        (entries('{"name": "Prefill", "symbols": 3}'), "named entry"),
        (entries('{"batch_size": "1", "seq_len": "9", "ctx_len": "8"}'), "seq_len 9 > ctx_len 8"),
    ],
)
def test_read_errors_name_file_and_problem(tmp_path, content, fragment):
    """A bad file gives one line: which file, and what is wrong with it."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        read_specializations(path)
    message = str(info.value)
    assert message.startswith(f"specializations file {path}: ")
    assert fragment in message
    assert "\n" not in message


def test_read_missing_file(tmp_path):
    """A missing file is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="missing.json: cannot read it"):
        read_specializations(tmp_path / "missing.json")


# --- model config cross-check ------------------------------------------------------------


def test_model_speculative_length_top_level_and_nested():
    """num_speculative_tokens is found at top level or under speculative_config."""
    assert model_speculative_length({"num_speculative_tokens": 3}) == 3
    assert model_speculative_length({"speculative_config": {"num_speculative_tokens": 2}}) == 2
    assert model_speculative_length({"model_type": "llama"}) is None
    assert model_speculative_length({"speculative_config": None}) is None


def test_model_config_disagreement_warns_naming_what_is_ignored():
    """Model says 3, user asks [0, 4]: one warning, the requested Ks win."""
    warnings = check_model_speculative_config({"num_speculative_tokens": 3}, (0, 4))
    assert warnings == ["model config says num_speculative_tokens=3; using the requested [0, 4] and ignoring 3"]


def test_model_config_agreement_is_silent():
    """Model says 4 and the largest requested K is 4: no warning; none without the key either."""
    nested = {"speculative_config": {"num_speculative_tokens": 4}}
    assert check_model_speculative_config(nested, (0, 4)) == []
    assert check_model_speculative_config({}, (0, 4)) == []


# --- golden files and schema -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_files_byte_for_byte(name):
    """Each golden file is exactly what the writer renders for its config."""
    options, fmt = GOLDEN_CASES[name]
    text = specializations_to_json(build_specializations(make_config(**options)), fmt=fmt)
    assert text == (GOLDEN / name).read_text()


def test_golden_matches_design_example():
    """The bs1/prefill32/ctx128/K[0,4] golden file holds the design brief's example (flat, string values)."""
    data = json.loads((GOLDEN / "bs1_prefill32_ctx128_k0_4.json").read_text())
    assert data == {
        "specializations": [
            {"batch_size": "1", "seq_len": "32", "ctx_len": "128", "num_logits_to_keep": "1"},
            {"batch_size": "1", "seq_len": "1", "ctx_len": "128", "num_logits_to_keep": "1"},
            {"batch_size": "1", "seq_len": "5", "ctx_len": "128", "num_logits_to_keep": "5"},
        ]
    }


def test_every_golden_file_is_covered():
    """No golden file is left without a test case."""
    assert sorted(p.name for p in GOLDEN.glob("*.json")) == sorted(GOLDEN_CASES)


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_files_validate_against_schema(name):
    """Every golden file is valid against specializations/schema.json."""
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(json.loads((GOLDEN / name).read_text()))


@pytest.mark.parametrize(
    "document",
    [
        {"specializations": [{"batch_size": 1, "seq_len": "1", "ctx_len": "8"}]},  # integer value
        {"specializations": [{"batch_size": "0", "seq_len": "1", "ctx_len": "8"}]},  # not positive
        {"specializations": [{"batch_size": "1", "seq_len": "1"}]},  # ctx_len missing
        {"specializations": []},
        {
            "specializations": [  # flat and named mixed
                {"batch_size": "1", "seq_len": "1", "ctx_len": "8"},
                {
                    "name": "Decode_1",
                    "symbols": {"batch_size": "1", "seq_len": "1", "ctx_len": "8"},
                },
            ]
        },
    ],
)
def test_schema_rejects_bad_files(document):
    """The schema refuses integers, zero sizes, missing keys, empty lists and mixed forms."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(document)
