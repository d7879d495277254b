"""``qspec bench`` across weight formats: equality per package, ratios per format, targets, the report's table."""

from __future__ import annotations

from qspec.bench import RunConfig, none_config, quick_options, render_markdown
from qspec.bench.analysis import Collected, equality_checks, with_ratios
from qspec.bench.peers.runners import llama_cpp_configs, ort_genai_configs
from qspec.bench.peers.workers import GREEDY, LOOKUP
from qspec.bench.report import (
    BenchReport,
    ConfigSummary,
    Equality,
    EqualityCheck,
    MachineInfo,
    Meta,
    MicroCall,
    MicroPackage,
    MicroReport,
    Overall,
)
from qspec.bench.runners import RequestResult
from qspec.runtime.metrics import RequestMetrics, aggregate
from tests.conftest import bench_targets

_micro_targets, evaluate_targets = bench_targets()._micro_targets, bench_targets().evaluate_targets

PLD_FP32 = RunConfig("pld", (0, 4), 1)
PLD_INT4 = RunConfig("pld", (0, 4), 1, "qspec", "int4")


def _collected(config: RunConfig, outputs: dict[str, list[int]]) -> Collected:
    """What the rounds would have produced: only the tokens matter to the equality checks."""
    c = Collected(config)
    for rid, tokens in outputs.items():
        c.requests[rid] = ("chat", RequestResult(tokens, "", RequestMetrics(arrival=0.0)))
    return c


def _checks(collected: list[Collected]):
    equality = equality_checks({c.config.key: c for c in collected})
    return equality, {c.config: c for c in equality.checks}


def test_speculative_outputs_are_checked_against_none_of_their_own_format():
    """int4 differs from fp32 (reported as agreement) but reproduces its own none: the headline holds."""
    equality, checks = _checks(
        [
            _collected(none_config("fp32", 1), {"a": [1, 2, 3], "b": [4, 5]}),
            _collected(PLD_FP32, {"a": [1, 2, 3], "b": [4, 5]}),
            _collected(none_config("int4", 1), {"a": [1, 2, 9], "b": [4, 5]}),  # a near-tie flipped at token 2
            _collected(PLD_INT4, {"a": [1, 2, 9], "b": [4, 5]}),
        ]
    )
    assert equality.speculative_equal_none is True
    assert equality.all_equal is False  # the format check is not equal
    assert (checks["pld[0,4]-int4@1"].reference, checks["pld[0,4]-int4@1"].kind) == ("none-int4@1", "speculative")
    fmt = checks["none-int4@1"]
    assert (fmt.reference, fmt.kind, fmt.equal, fmt.total) == ("none@1", "format", 1, 2)
    assert fmt.mean_common_prefix == round((2 / 3 + 1.0) / 2, 4)
    assert "none@1" not in checks  # the reference of the others checks nothing


def test_a_quantized_speculative_mismatch_fails_the_headline():
    """pld-int4 equal to fp32 none but not to int4 none is a failure: the reference is its own package's none."""
    equality, checks = _checks(
        [
            _collected(none_config("fp32", 1), {"a": [1, 2, 3]}),
            _collected(none_config("int4", 1), {"a": [1, 2, 9]}),
            _collected(PLD_INT4, {"a": [1, 2, 3]}),
        ]
    )
    assert equality.speculative_equal_none is False
    assert checks["pld[0,4]-int4@1"].mismatches[0].first_difference_at == 2


def test_peers_are_compared_with_none_of_their_weight_format():
    """ORT GenAI int4 against qspec none-int4; fp32 peers and llama.cpp's Q4_1 (no qspec format) against none@1."""
    ort_fp32, ort_int4 = ort_genai_configs("fp32"), ort_genai_configs("int4")
    llama = llama_cpp_configs("m.Q4_1.gguf")
    same = {"a": [1, 2, 3]}
    _, checks = _checks(
        [
            _collected(none_config("fp32", 1), same),
            _collected(none_config("int4", 1), {"a": [1, 2, 9]}),
            _collected(ort_fp32[GREEDY], same),
            _collected(ort_int4[LOOKUP], {"a": [1, 2, 9]}),
            _collected(llama[GREEDY], same),
        ]
    )
    assert llama[GREEDY].weight_format == "q4_1" and ort_int4[LOOKUP].weight_format == "int4"
    assert {key: (c.reference, c.kind, c.equal) for key, c in checks.items() if c.kind == "baseline"} == {
        "ort-genai-fp32@1": ("none@1", "baseline", 1),
        "ort-genai-int4-ngram[4]@1": ("none-int4@1", "baseline", 1),  # equal to qspec int4, not to fp32
        "llama.cpp-q4_1@1": ("none@1", "baseline", 1),
    }


def _summary(config: RunConfig, tokens_per_s: float) -> ConfigSummary:
    """A summary with only what the targets read: output tokens/s (and requests/s, the same number)."""
    rates = {"output_tokens_per_s": tokens_per_s, "requests_per_s": tokens_per_s}
    overall = Overall.from_metrics(aggregate([], 1.0, {})).model_copy(update=rates)
    return ConfigSummary.for_config(config, overall=overall, per_category={}, round_walls_s=[], round_other_cpu=[])


def _hand_made_run() -> list[ConfigSummary]:
    """fp32 and int4 qspec against ORT GenAI (fp32, int4) and llama.cpp; tokens/s chosen by hand."""
    ort_fp32, ort_int4 = ort_genai_configs("fp32"), ort_genai_configs("int4")
    llama = llama_cpp_configs("m.Q4_1.gguf")
    speeds = [
        (none_config("fp32", 1), 20.0),
        (PLD_FP32, 26.0),
        (none_config("int4", 1), 45.0),
        (PLD_INT4, 70.0),
        (ort_fp32[GREEDY], 18.0),  # fp32: 20 / 18 = 1.11 PASS
        (ort_fp32[LOOKUP], 21.0),
        (ort_int4[GREEDY], 50.0),  # int4: 45 / 50 = 0.90 MISS
        (ort_int4[LOOKUP], 60.0),  # the peers' fastest n-gram: 70 / 60 = 1.17 MISS (goal 1.3)
        (llama[GREEDY], 37.0),
        (llama[LOOKUP], 35.0),  # 70 / 35 = 2.0 PASS
    ]
    return with_ratios([_summary(config, speed) for config, speed in speeds])


def test_peer_targets_compare_greedy_per_format_and_the_fastest_variable_k():
    """none >= ORT GenAI greedy at fp32 and at int4 separately; pld vs peers takes the fastest format and names it."""
    targets = {t.target: t for t in evaluate_targets(_hand_made_run(), None)}
    fp32 = targets["qspec none vs ONNX Runtime GenAI greedy (fp32 both), tokens/s"]
    int4 = targets["qspec none vs ONNX Runtime GenAI greedy (int4 both), tokens/s"]
    assert (fp32.status, fp32.measured) == ("PASS", "1.11 x")
    assert (int4.status, int4.measured) == ("MISS", "0.90 x")
    ngram = targets[
        "qspec fastest variable-K pld (pld[0,4]-int4, int4 wins) vs ONNX Runtime GenAI n-gram "
        "(best: ort-genai-int4-ngram[4]), tokens/s"
    ]
    assert (ngram.status, ngram.measured) == ("MISS", "1.17 x")
    lookup = targets[
        "qspec fastest variable-K pld (pld[0,4]-int4, int4 wins) vs llama.cpp prompt lookup "
        "(best: llama.cpp-q4_1-pld[4]), tokens/s"
    ]
    assert (lookup.status, lookup.measured) == ("PASS", "2.00 x")
    # Each format's variable K is compared with its own none: int4 70 / 45, fp32 26 / 20.
    assert targets["pld[0,4]-int4 vs none, requests/s (batch 1)"].measured == "1.556 x"
    assert targets["pld[0,4] vs none, requests/s (batch 1)"].measured == "1.300 x"


def test_greedy_target_without_qspec_int4_says_so():
    """ORT GenAI int4 ran but qspec int4 did not (--weight-formats fp32): n/a with the reason, not a crash."""
    summaries = [s for s in _hand_made_run() if s.backend != "qspec" or s.weight_format != "int4"]
    [target] = [t for t in evaluate_targets(summaries, None) if "(int4 both)" in t.target]
    assert (target.status, target.measured) == ("n/a", "qspec int4 not run (--weight-formats)")
    [ngram] = [t for t in evaluate_targets(summaries, None) if "n-gram" in t.target]
    assert "(pld[0,4], fp32 wins)" in ngram.target


def test_floor_targets_stay_fp32():
    """An int4 package far under its own floor does not stand in for fp32's K=0 / K=4 targets."""

    def package(weight_format: str, floor_ms: float, ms: float) -> MicroPackage:
        calls = [
            MicroCall(
                specialization=k, shape="", median_ms=ms, tokens_per_call=1, ratio_to_floor=round(ms / floor_ms, 2)
            )
            for k in ("K=0", "K=4")
        ]
        weight_bytes = int(floor_ms * 1e6)
        return MicroPackage(
            batch=1,
            weight_format=weight_format,
            package=weight_format,
            weight_bytes=weight_bytes,
            floor_ms=floor_ms,
            iterations=1,
            calls=calls,
        )

    micro = MicroReport(copy_bandwidth_gb_s=1.0, packages=[package("int4", 5.0, 5.0), package("fp32", 20.0, 30.0)])
    targets = {t.target: t for t in _micro_targets(micro)}
    assert targets["K=0 call / weight-streaming floor (fp32, batch 1)"].measured == "1.50 x (30.0 ms)"
    assert targets["K=0 call / weight-streaming floor (fp32, batch 1)"].status == "MISS"


def _hand_made_report(summaries: list[ConfigSummary]) -> BenchReport:
    """A report around ``summaries``: int4 none agrees with fp32 none on 1 of 2 requests."""
    machine = MachineInfo(
        cpu="cpu",
        cores=2,
        memory_gb=8.0,
        python="3",
        onnxruntime="1",
        numpy="2",
        qspec="0",
        other_processes_cpu_share=0.0,
    )
    meta = Meta(
        model="m.gguf",
        packages={},
        started="now",
        wall_s=1.0,
        phases={},
        options=quick_options(),
        prompts=2,
        categories=["chat"],
        machine=machine,
        runners={},
        notes=[],
    )
    check = EqualityCheck(config="none-int4@1", reference="none@1", kind="format", equal=1, total=2, mismatches=[])
    peer = EqualityCheck(
        config="ort-genai-int4@1", reference="none-int4@1", kind="baseline", equal=2, total=2, mismatches=[]
    )
    equality = Equality(speculative_equal_none=True, all_equal=False, checks=[check, peer])
    return BenchReport(meta=meta, configs=summaries, micro=None, memory=None, equality=equality, outputs={})


def test_markdown_shows_the_format_of_every_qspec_row():
    """report.md: a weights column, the weight-format table with int4 against fp32 none."""
    markdown = render_markdown(_hand_made_report(_hand_made_run()))
    assert "## Weight formats (batch 1)" in markdown
    assert "| pld[0,4]-int4@1 | int4 |" in markdown
    assert "| none@1 | fp32 |" in markdown
    assert "| int4 | 45.00 | 2.250 | pld[0,4]-int4 | 70.00 | 1.556 | 1/2 | 1.000 |" in markdown
    # Peers: ORT GenAI int4 against none-int4 (50 / 45 tok/s); one without a check against none@1 (37 / 20).
    assert "| ort-genai-int4@1 | 50.00 | none-int4@1 | 1.111 |" in markdown
    assert "| llama.cpp-q4_1@1 | 37.00 | none@1 | 1.850 |" in markdown
    assert "| ort-genai-int4@1 | int4 |" in markdown  # the weights column: peers say theirs too


def test_a_given_int4_package_is_the_runs_only_format(tiny_model, tmp_path):
    """`qspec bench PACKAGE` on an int4 package: int4 only, its whole K grid, named -int4, and a note says so."""
    from qspec.bench.run import make_plan
    from qspec.compile import CompileOptions, compile_package
    from qspec.specializations import make_config

    spec = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=64)
    package, _, _ = compile_package(
        tiny_model("llama"), CompileOptions(specialization=spec, weight_format="int4"), output=tmp_path / "p"
    )
    plan = make_plan(str(package), quick_options(methods="pld", k_lists="4;0,4", peers=False, baselines=False))
    assert plan.options.weight_formats == ("int4",)
    assert [c.key for c in plan.configs] == ["none-int4@1", "pld[4]-int4@1", "pld[0,4]-int4@1"]
    assert any("weight format int4 only" in note for note in plan.resolved.notes)
