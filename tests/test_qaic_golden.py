"""qspec's vendor files against what QEfficient's own compile path wrote (specializations/golden/qefficient)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qspec.backends.qaic import QaicOptions, custom_io_yaml, mdp_partition_config, qaic_compile_argv
from qspec.backends.qaic_target import resolve_precisions
from qspec.ccl import ccl_lists
from qspec.spec_file import specializations_to_json
from qspec.specializations import build_specializations, make_config

FIXTURES = json.loads(
    (Path(__file__).parents[1] / "specializations" / "golden" / "qefficient" / "compile_path.json").read_text()
)
CASES = FIXTURES["compile"]
MULTI_K = [f"k{ks}{cb}" for ks in ("3", "0_3", "1_2_3", "0_1_2_3") for cb in ("", "_fbs4")]
# QEfficient's continuous-batching prefill carries full_batch_exec_size=1 ("TODO: remove; not required" in
# its build_prefill_specialization). It is no dimension of the graph, and qspec's contract test requires
# the keys to be exactly the graph's symbolic dimensions, so qspec leaves it out on purpose.
NOT_A_GRAPH_DIMENSION = "full_batch_exec_size"
QEFF_MDP_FILE = "mdp_ts_4.json"  # QEfficient's name for the template; qspec names it mdp.json (cosmetic)


def qspec_named(inputs: dict) -> list[dict]:
    """qspec's named specializations for a fixture's inputs (qspec writes flat by default; QEfficient 1.22
    only named, so the named form is the one compared)."""
    config = make_config(
        num_speculative_tokens=inputs["num_speculative_tokens"],
        prefill_seq_len=inputs["prefill_seq_len"],
        ctx_len=inputs["ctx_len"],
        full_batch_size=inputs["full_batch_size"],
    )
    return json.loads(specializations_to_json(build_specializations(config), fmt="named"))["specializations"]


def without_exec_size(entries: list[dict]) -> list[dict]:
    return [{**e, "symbols": {k: v for k, v in e["symbols"].items() if k != NOT_A_GRAPH_DIMENSION}} for e in entries]


def test_fixtures_record_their_provenance():
    """The fixtures name the repository and commit they were produced from."""
    assert FIXTURES["provenance"] == {
        "repository": "github:quic/efficient-transformers",
        "commit": "ebf55e8159c8b87bff6d8028541b824244b16c81",
    }
    assert set(MULTI_K) <= set(CASES)


@pytest.mark.parametrize("name", MULTI_K)
def test_named_specializations_equal_qefficient(name):
    """Names and symbols equal QEfficient's, but for full_batch_exec_size (not a graph dimension)."""
    case = CASES[name]
    expected = case["specializations"]["specializations"]
    if case["inputs"]["full_batch_size"]:
        assert expected[0]["symbols"][NOT_A_GRAPH_DIMENSION] == "1"
    assert qspec_named(case["inputs"]) == without_exec_size(expected)


@pytest.mark.parametrize("name", MULTI_K)
def test_custom_io_equals_qefficient_byte_for_byte(name):
    """custom_io.yaml of a 2-layer float32 target: the same text QEfficient writes."""
    assert custom_io_yaml(2) == CASES[name]["custom_io_yaml"]


@pytest.mark.parametrize("name", MULTI_K)
def test_compile_command_equals_qefficient(name):
    """The qaic-compile command, paths relative to the compile directory, equals QEfficient's."""
    argv = qaic_compile_argv(
        compiler="/opt/qti-aic/exec/qaic-compile",
        onnx_path="model.onnx",
        specializations_path="specializations.json",
        custom_io_path="custom_io.yaml",
        qpc_dir="qpc",
        options=QaicOptions(),
    )
    assert argv == CASES[name]["command"]


def test_mxint8_mxfp6_multi_device_equal_qefficient():
    """mxint8 KV + mxfp6 weights on 4 devices with mos and depth-first: custom IO, command and partition
    template as QEfficient writes them (the template's file name aside)."""
    case = CASES["k0_4_mxint8_mxfp6_4dev"]
    options = QaicOptions(mxint8_kv_cache=True, mxfp6_matmul=True, num_devices=4, mos=1, aic_enable_depth_first=True)
    precisions = resolve_precisions(hw_version="ai100", graph_dtype="float32", mxint8_kv_cache=True)
    assert custom_io_yaml(2, kv_dtype=precisions.kv_precision) == case["custom_io_yaml"]
    argv = qaic_compile_argv(
        compiler="/opt/qti-aic/exec/qaic-compile",
        onnx_path="model.onnx",
        specializations_path="specializations.json",
        custom_io_path="custom_io.yaml",
        qpc_dir="qpc",
        options=options,
        precisions=precisions,
        mdp_path=QEFF_MDP_FILE,
    )
    assert argv == case["command"]
    assert mdp_partition_config(4, 16) == case["mdp"][QEFF_MDP_FILE]
    assert qspec_named(case["inputs"]) == case["specializations"]["specializations"]


def test_qspec_keeps_the_k_qefficient_drops():
    """Differs on purpose: at prefill_seq_len == K + 1 without continuous batching QEfficient drops the K
    decode shape (its duplicate check compares seq_len only, though num_logits_to_keep differs); qspec
    keeps it, so K=3 can be dispatched."""
    case = CASES["k0_3_pl4_drops_k3"]
    theirs = case["specializations"]["specializations"]
    ours = qspec_named(case["inputs"])
    assert [e["symbols"]["seq_len"] for e in theirs] == ["4", "1"]
    assert [e["symbols"]["seq_len"] for e in ours] == ["4", "1", "4"]
    assert ours[2]["symbols"]["num_logits_to_keep"] == "4"  # the verify shape: 4 logits, not the prefill's 1
    assert [e["name"] for e in ours] == ["Prefill", "Decode_0", "Decode_1"]
    assert ours[:1] == theirs[:1] and ours[1]["symbols"] == theirs[1]["symbols"]


@pytest.mark.parametrize("name", sorted(FIXTURES["ccl"]))
def test_ccl_lists_equal_qefficient(name):
    """qaic's CCL rule gives QEfficient's prefill and decode buckets for the same inputs (automatic included)."""
    case = FIXTURES["ccl"][name]
    inputs = case["inputs"]
    given = [inputs["comp_ctx_lengths_prefill"], inputs["comp_ctx_lengths_decode"]]
    lists = ccl_lists(
        "qefficient",
        *(tuple(values) if values else None for values in given),
        ctx_len=inputs["ctx_len"],
        prefill_seq_len=inputs["prefill_seq_len"],
        auto=given == [None, None],
    )
    assert (list(lists.prefill), list(lists.decode)) == (case["prefill"], case["decode"])
    assert case["ctx_len"] == inputs["ctx_len"]


def test_ccl_times_k_is_qspec_only():
    """Differs on purpose: QEfficient refuses CCL with a K list (NotImplementedError); qspec compiles every K
    at every decode bucket, with QEfficient's bucket rules on the qaic backend."""
    config = make_config(
        num_speculative_tokens="0,3",
        ctx_len=8192,
        comp_ctx_lengths_prefill="2048",
        comp_ctx_lengths_decode="1024,4096",
        ccl_rule="qefficient",
    )
    specs = build_specializations(config)
    assert config.buckets("prefill") == FIXTURES["ccl"]["ctx8192_p2048_d1024_4096"]["prefill"]
    assert [(s.seq_len, s.comp_ctx_lengths) for s in specs[2:]] == [
        (1, 1024), (4, 1024), (1, 4096), (4, 4096), (1, 8192), (4, 8192)
    ]  # fmt: skip
