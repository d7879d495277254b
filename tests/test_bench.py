"""``qspec bench``: the report of a small run on a tiny random model, the report math, and bad options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qspec.bench import (
    BenchOptions,
    BenchReport,
    ConfigSummary,
    category_rates,
    compare_outputs,
    contention_notes,
    full_options,
    load_prompts,
    plan_configs,
    quick_options,
    ratio,
    rotated,
    rounds,
    with_ratios,
)
from qspec.bench.analysis import CategoryInput
from qspec.bench.peers.runners import PEER_MODULES
from qspec.bench.report import Mismatch, Overall
from qspec.errors import ConfigError
from qspec.runtime.metrics import aggregate
from tests.conftest import bench_targets

PROMPTS = [
    {"question_id": 1, "category": "code", "turns": ["x = 1; y = x + x; print(y) # rename x to z", "Now in C."]},
    {"question_id": 2, "category": "code", "turns": ["def add(a, b): return a + b", "Explain it."]},
    {"question_id": 3, "category": "chat", "turns": ["Hello there, how are you today?", "And tomorrow?"]},
    {"question_id": 4, "category": "chat", "turns": ["Tell me a story about a cat and a cat.", "Shorter."]},
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def bench_run(tiny_model, prompts_file, tmp_path_factory):
    """One small run through the CLI: batch 1 and 2, pld with [4] and [0,4], both turns, fp32 and int4."""
    from qspec_cli.main import app

    out = tmp_path_factory.mktemp("bench-out")
    args = [
        "bench",
        str(tiny_model("llama")),
        "--output",
        str(out),
        "--prompts",
        str(prompts_file),
        "--per-category",
        "0",
        "--turns",
        "2",
        "--max-new-tokens",
        "12",
        "--batch-sizes",
        "1,2",
        "--methods",
        "pld",
        "--k-lists",
        "4;0,4",
        "--analysis",
        "--micro-iterations",
        "2",
        "--round-size",
        "2",
        "--ctx-len",
        "128",
        "--prefill-seq-len",
        "8",
        "--packages-dir",
        str(out / "packages"),
        "--comp-ctx-lengths-prefill",
        "32",
        "--comp-ctx-lengths-decode",
        "32,64",
        "--weight-formats",
        "int4",  # fp32 comes first on its own
    ]
    with pytest.MonkeyPatch.context() as patch:  # the peers as where they are not installed (CI), whatever is here
        for peer in PEER_MODULES:
            patch.setitem(PEER_MODULES, peer, "qspec_tests_no_such_module")
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, BenchReport.model_validate_json((out / "report.json").read_text()), result.output


def test_report_files_and_configs(bench_run):
    """report.json, report.md and throughput.png exist; every configuration and baseline is reported."""
    out, report, _ = bench_run
    assert (out / "report.md").is_file() and (out / "throughput.png").stat().st_size > 0
    keys = {s.key for s in report.configs}
    for batch in (1, 2):
        assert {f"none@{batch}", f"pld[4]@{batch}", f"pld[0,4]@{batch}"} <= keys
    assert {"transformers@1", "transformers-pld[4]@1"} <= keys
    assert report.meta.options.weight_formats == ("fp32", "int4")
    # int4: none and the variable K list, batch 1 only.
    assert sorted(k for k in keys if "int4" in k) == ["none-int4@1", "pld[0,4]-int4@1"]
    assert {s.weight_format for s in report.configs if s.backend == "qspec"} == {"fp32", "int4"}
    assert set(report.meta.packages) == {"1", "2", "int4@1"}
    none = report.config("none@1")
    assert none.overall.requests == 8  # 4 prompts x 2 turns
    assert set(none.per_category) == {"chat", "code"}
    markdown = (out / "report.md").read_text()
    assert "## Targets" not in markdown  # the project's goals are bench/targets.py's, not the tool's
    for heading in (
        "## Greedy outputs",
        "## Per configuration",
        "## Per category, batch 1",
        "## Weight formats (batch 1)",
        "## One call per specialization",
        "## Memory",
        "## Host time per decode step",
    ):
        assert heading in markdown
    step = none.overall.step  # a qspec engine says where its wall time went, a baseline does not
    assert step.host_ms > 0 and 0 < step.host_share < 1 and report.config("transformers@1").overall.step is None


def test_peers_not_installed_are_skipped_with_the_reason(bench_run):
    """Without the peers the run goes on; the report, report.md and stderr say what was skipped and why."""
    out, report, output = bench_run
    assert not [s for s in report.configs if s.backend not in ("qspec", "transformers")]
    reasons = {s.what.split()[0]: s.why for s in report.meta.skipped}
    assert set(reasons) == {"ort-genai", "llama.cpp"}
    assert all("not installed (pip install 'qspec[peers]')" in why for why in reasons.values())
    assert "## Skipped" in (out / "report.md").read_text()
    assert "Skipped: llama.cpp" in output  # the CLI's stderr


def test_speculative_outputs_equal_none(bench_run):
    """Greedy speculative outputs equal none's, and the report says so."""
    out, report, stdout = bench_run
    assert report.equality.speculative_equal_none is True
    assert "is **equal** to `none`'s" in (out / "report.md").read_text()
    assert "outputs equal to none's" in stdout
    checks = {c.config: c for c in report.equality.checks}
    int4 = checks["pld[0,4]-int4@1"]  # against none of its own package, and equal
    assert (int4.reference, int4.kind, int4.equal) == ("none-int4@1", "speculative", int4.total)
    assert int4.total == 8
    fmt = checks["none-int4@1"]  # against fp32 none: agreement, reported, not a gate
    assert (fmt.reference, fmt.kind, fmt.total) == ("none@1", "format", 8)
    assert 0 <= fmt.mean_common_prefix <= 1
    assert report.config("pld[0,4]-int4@1").overall.ratio_to_none is not None


def test_each_package_runs_in_a_process_of_its_own(bench_run):
    """qspec's configurations run as a peer's do: one worker process per package, not the bench's; what a
    worker generates is what the engine generates in this process."""
    import os

    from qspec.bench.plan import RunConfig, Steps, none_config
    from qspec.bench.runners import QspecRunner
    from qspec.runtime import Engine, SamplingParams

    _, report, _ = bench_run
    packages = {("fp32", 1): Path(report.meta.packages["1"]), ("int4", 1): Path(report.meta.packages["int4@1"])}
    configs = [RunConfig("pld", (0, 4), 1, weight_format="int4"), none_config("fp32", 1)]
    runner = QspecRunner(packages, configs, num_threads=1, dispatch="auto", draft_package=None)
    try:
        runner.start(Steps(None))
        pids = {key: worker.process.pid for key, worker in runner.workers.items()}
        assert set(pids) == set(packages) and len(set(pids.values())) == 2 and os.getpid() not in pids.values()
        prompts = [runner.encode_chat([{"role": "user", "content": p["turns"][0]}]) for p in PROMPTS[:2]]
        result = runner.run(configs[0], prompts, 10)
        engine = Engine(packages["int4", 1], method="pld", num_speculative_tokens=[0, 4], num_threads=1)
        expected = engine.generate(prompts, SamplingParams(max_new_tokens=10))
        assert [r.tokens for r in result.requests] == [list(o.token_ids) for o in expected]
        assert [r.text for r in result.requests] == [o.text for o in expected]
        assert result.wall_s > 0 and result.calls["prefill"] >= 2  # a call per prefill chunk
        assert runner.stop() is None and not runner.workers
    finally:
        runner.close()


def test_report_has_micro_and_memory_and_targets_read_it(bench_run, tmp_path):
    """The micro-benchmark and the memory probes have numbers; bench/targets.py (outside the package) reads
    report.json and gives each target a status."""
    folder, report, _ = bench_run
    targets = bench_targets().evaluate_targets(report.configs, report.memory, report.micro)
    assert all(t.status in ("PASS", "MISS", "n/a") for t in targets)
    assert any("peak RSS" in t.target and t.status != "n/a" for t in targets)
    host = [t for t in targets if "host time per decode step" in t.target]
    assert [t.target.split()[1] for t in host] == ["none", "none-int4"] and all(t.status != "n/a" for t in host)
    assert not any(t.target.startswith("K=4 call, bucket 256") for t in targets)  # no 256 bucket here
    markdown = tmp_path / "report.md"
    assert bench_targets().main([str(folder / "report.json"), "--markdown", str(markdown)]) == 0
    assert markdown.read_text().startswith("\n## Targets")
    fp32, vendor, fp32_b2, int4 = report.micro.packages
    assert (fp32.weight_format, fp32_b2.weight_format, int4.weight_format) == ("fp32", "fp32", "int4")
    # the bucketed fp32 package's model.onnx too: explicit attention, the graph its buckets are for
    assert (vendor.graph, vendor.batch, vendor.package) == ("vendor", 1, fp32.package)
    assert [c.specialization for c in vendor.calls] == [c.specialization for c in fp32.calls]
    assert (int4.batch, int4.package) == (1, report.meta.packages["int4@1"])
    # Each package against its own format's floor: packed 4-bit weights stream fewer bytes than fp32.
    assert int4.weight_bytes < fp32.weight_bytes / 2 and int4.floor_ms <= fp32.floor_ms
    assert [c.specialization for c in int4.calls] == [c.specialization for c in fp32.calls]
    int4_floor_ms = int4.weight_bytes / (report.micro.copy_bandwidth_gb_s * 1e9) * 1000  # floor_ms is rounded
    call = max(int4.calls, key=lambda c: c.median_ms)
    assert call.ratio_to_floor == pytest.approx(call.median_ms / int4_floor_ms, rel=0.2)
    calls = fp32.calls
    assert [c.specialization for c in calls] == [  # every K in every bucket (128 = ctx_len is always one)
        "prefill@32",
        "prefill@128",
        "K=0@32",
        "K=4@32",
        "K=0@64",
        "K=4@64",
        "K=0@128",
        "K=4@128",
    ]
    probe = report.memory.probes["pld[0,4]@1"]
    assert probe.peak_rss_mb >= probe.rss_loaded_mb > 0
    assert report.memory.ratio > 0
    assert report.memory.many_config == "pld[0,4]@1"  # the fp32 K=0 package's comparison stays fp32
    assert report.memory.probes["pld[0,4]-int4@1"].peak_rss_mb > 0
    assert all(0 <= share <= 1 for s in report.configs for share in s.round_other_cpu)


def test_report_has_ttft_per_prefill_chunk_size(bench_run):
    """Each batch-1 package prefills the prompts in chunks of its own size (8) and of every default size it
    takes (16 and 32: the prefill bucket is 32): longer chunks, fewer calls; the table is in report.md."""
    out, report, _ = bench_run
    chunks = report.micro.prefill
    assert [(c.weight_format, c.prefill_seq_len, c.package_default) for c in chunks] == [
        ("fp32", 8, True),
        ("fp32", 16, False),
        ("fp32", 32, False),
        ("int4", 8, True),
        ("int4", 16, False),
        ("int4", 32, False),
    ]
    assert all(c.ttft_median_ms > 0 for c in chunks)
    for fmt in ("fp32", "int4"):
        calls = [c.prefill_calls_per_prompt for c in chunks if c.weight_format == fmt]
        assert calls[0] > calls[-1] >= 1 and calls == sorted(calls, reverse=True)
    assert report.micro.prefill_prompts == len(PROMPTS) and report.micro.prefill_rounds == 2
    markdown = (out / "report.md").read_text()
    assert "## TTFT per prefill chunk size" in markdown and "| fp32 | **8** |" in markdown


def _summary(method: str, batch: int, requests_per_s: float, per_category: dict[str, float]) -> ConfigSummary:
    """A summary with only what the ratios read: requests/s overall and per category."""
    overall = Overall.from_metrics(aggregate([], 1.0, {})).model_copy(update={"requests_per_s": requests_per_s})
    rows = category_rates([CategoryInput(c, 1, 1.0) for c in per_category])
    rows = {c: row.model_copy(update={"requests_per_s": per_category[c]}) for c, row in rows.items()}
    return ConfigSummary(
        key=f"{method}@{batch}",
        name=method,
        method=method,
        ks=[0],
        batch=batch,
        backend="qspec",
        overall=overall,
        per_category=rows,
        round_walls_s=[],
        round_other_cpu=[],
    )


def test_ratio_math():
    """Ratios against none at the same batch size, overall and per category."""
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    table = category_rates([CategoryInput("a", 10, 2.0), CategoryInput("a", 30, 4.0)])
    assert table["a"].requests_per_s == round(2 / 6, 4)  # 2 requests over 6 s of latency
    assert table["a"].output_tokens_per_s == round(40 / 6, 2)
    summaries = with_ratios(
        [
            _summary("none", 1, 2.0, {"a": 1.0}),
            _summary("pld", 1, 3.0, {"a": 1.5}),
            _summary("pld", 4, 9.0, {}),  # no none at batch 4
        ]
    )
    assert summaries[1].overall.ratio_to_none == 1.5
    assert summaries[1].per_category["a"].ratio_to_none == 1.5
    assert summaries[2].overall.ratio_to_none is None


def test_compare_outputs_reports_first_difference():
    """[1, 2, 3] against [1, 2, 4] differs at token 2; equal lists count as equal."""
    result = compare_outputs({"a": [1, 2, 3], "b": [5]}, {"a": [1, 2, 4], "b": [5]})
    assert (result.equal, result.total) == (1, 2)
    assert result.mismatches == [Mismatch(request="a", first_difference_at=2, lengths=[3, 3])]


def test_contention_note_names_the_worst_rounds():
    """No note on a quiet machine; otherwise the share and the worst config-rounds."""
    assert contention_notes(0.02, {"none@1": [0.01, 0.02]}) == []
    [note] = contention_notes(0.25, {"none@1": [0.05, 0.6], "pld[4]@1": [0.3]})
    assert note.startswith("other processes used 25% of the CPU")
    assert "none@1 round 2: 60%, pld[4]@1 round 1: 30%" in note


def test_rounds_and_rotation():
    """Rounds cover every prompt once; each round starts one configuration later."""
    assert [list(r) for r in rounds(5, 2)] == [[0, 1], [2, 3], [4]]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_batch_configurations_run_more_prompts_in_one_run_per_round():
    """At batch > 1 a round's share of the batch prompts goes in one run (a run drains at its end: rounds of
    8 requests over 4 slots made that a large share of every run). At batch 1 a round goes prompt by prompt,
    every configuration on a prompt before the next (order rotated each prompt), so drift hits them alike."""
    from types import SimpleNamespace

    from qspec.bench.analysis import Collected
    from qspec.bench.plan import Steps
    from qspec.bench.run import even_rounds, run_phase
    from qspec.bench.runners import RequestResult, RoundResult
    from qspec.runtime.metrics import RequestMetrics

    assert [list(r) for r in even_rounds(5, 4)] == [[0], [1], [2], [3, 4]]
    assert [len(r) for r in even_rounds(80, 2)] == [40, 40]
    options = quick_options(methods="pld", k_lists="0,4", baselines=False, peers=False, round_size=2)
    configs = [c for c in plan_configs(options) if c.weight_format == "fp32"]
    seen = []

    class Recorder:
        def run(self, config, ids, max_new_tokens):
            seen.append((config.key, [i[0] for i in ids]))
            return RoundResult([RequestResult([1], "", RequestMetrics(arrival=0.0)) for _ in ids], 0.5 * len(ids))

    requests = [(str(i), "c", [i]) for i in range(4)]  # batch 1: 4 prompts, rounds of 2
    batch_requests = [(str(i), "c", [i]) for i in range(10)]  # batch > 1: those and 6 more
    collected = {c.key: Collected(c) for c in configs}
    plan = SimpleNamespace(options=options, configs=configs)
    run_phase(plan, {c.key: Recorder() for c in configs}, requests, collected, 1, Steps(None), batch_requests)
    assert len(collected["none@4"].requests) == 10 and len(collected["none@1"].requests) == 4
    assert collected["none@1"].walls == [1.0, 1.0] and collected["none@4"].walls == [2.5, 2.5]
    five = [0, 1, 2, 3, 4]
    assert seen == [  # round 1: the batch-1 block first, prompt by prompt, each prompt's order rotated
        ("none@1", [0]),
        ("pld[0,4]@1", [0]),
        ("pld[0,4]@1", [1]),
        ("none@1", [1]),
        ("none@4", five),
        ("pld[0,4]@4", five),
        ("none@4", [5, 6, 7, 8, 9]),  # round 2: the blocks rotated, batch 1 last
        ("pld[0,4]@4", [5, 6, 7, 8, 9]),
        ("pld[0,4]@1", [2]),
        ("none@1", [2]),
        ("none@1", [3]),
        ("pld[0,4]@1", [3]),
    ]


def test_each_baseline_runs_beside_the_configurations_it_is_compared_with():
    """A prompt's batch-1 runs: ONNX Runtime GenAI's greedy right after qspec's ``none`` of its format, its n-gram
    among that format's speculative configurations, llama.cpp (no qspec format) last; run_phase uses this order."""
    from qspec.bench.peers.runners import llama_cpp_configs, ort_genai_configs
    from qspec.bench.plan import beside_baselines

    options = quick_options(methods="pld,suffix", k_lists="0,4;0,1,2,4", batch_sizes="1,4", weight_formats="fp32,int4")
    peers = [
        *ort_genai_configs("fp32").values(),
        *ort_genai_configs("int4").values(),
        *llama_cpp_configs("SmolLM2-135M-Instruct.Q4_1.gguf").values(),
    ]
    single = [c for c in plan_configs(options) + peers if c.batch == 1]
    assert [c.key for c in beside_baselines(single)] == [
        "none@1",
        "transformers@1",
        "ort-genai-fp32@1",
        "pld[0,4]@1",
        "pld[0,1,2,4]@1",
        "transformers-pld[4]@1",
        "ort-genai-fp32-ngram[4]@1",
        "suffix[0,4]@1",
        "suffix[0,1,2,4]@1",
        "none-int4@1",
        "ort-genai-int4@1",
        "pld[0,4]-int4@1",
        "pld[0,1,2,4]-int4@1",
        "ort-genai-int4-ngram[4]@1",
        "suffix[0,4]-int4@1",
        "suffix[0,1,2,4]-int4@1",
        "llama.cpp-q4_1@1",
        "llama.cpp-q4_1-pld[4]@1",
    ]
    assert sorted(c.key for c in beside_baselines(single)) == sorted(c.key for c in single)


def test_plan_takes_more_prompts_at_batch_above_one(tiny_model, prompts_file):
    """``batch_per_category`` picks the first N of each category for batch > 1 (never fewer than batch 1's)."""
    from qspec.bench.run import make_plan

    def ids(**options):
        plan = make_plan(
            str(tiny_model("llama")),
            quick_options(prompts=prompts_file, methods="pld", k_lists="0,4", peers=False, baselines=False, **options),
        )
        return [p.id for p in plan.prompts], [p.id for p in plan.batch_prompts]

    assert ids(per_category=1) == (["1", "3"], ["1", "2", "3", "4"])  # default 10 a category: all of these
    assert ids(per_category=2, batch_per_category=1) == (["1", "2", "3", "4"],) * 2
    assert ids(per_category=1, batch_sizes="1") == (["1", "3"],) * 2  # no batch > 1: nothing more to read


def test_plan_and_prompts(prompts_file):
    """Quick preset: fp32 none plus method x K list per batch size, int4 none and variable K at batch 1, baselines."""
    configs = plan_configs(quick_options(methods="pld", k_lists="4;0,4"))
    assert [c.key for c in configs] == [
        "none@1",
        "pld[4]@1",
        "pld[0,4]@1",
        "none@4",
        "pld[4]@4",
        "pld[0,4]@4",
        "none-int4@1",
        "pld[0,4]-int4@1",
        "transformers@1",
        "transformers-pld[4]@1",
    ]
    assert [c.weight_format for c in configs[:8]] == ["fp32"] * 6 + ["int4"] * 2
    assert [p.id for p in load_prompts(prompts_file, per_category=1)] == ["1", "3"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_sizes": "0"}, "batch_sizes"),
        ({"methods": "pld,beam"}, "beam"),
        ({"k_lists": "4;a"}, "not an integer"),
        ({"methods": "draft"}, "draft_package"),
        ({"turns": 3}, "turns"),
        ({"weight_formats": "fp32,int3"}, "int3"),
        ({"weight_formats": ["fp16"]}, "choose from fp32, int8, int4"),
        ({"prefill_chunk_sizes": "64,512"}, r"prefill_chunk_sizes \[512\] exceed 256"),
        ({"prefill_chunk_sizes": "0"}, "sizes >= 1"),
        ({"tree_widths": "1,3"}, r"give 1 \(chains\), 2 \(trees\) or 1,2"),
        ({"methods": "pld", "tree_widths": "1,2"}, "are for head methods"),
    ],
)
def test_bad_options(overrides, message):
    """Bad options are one-line ConfigErrors naming the value."""
    with pytest.raises(ConfigError, match=message):
        BenchOptions.create(**overrides)


def test_cli_bad_flag_is_a_clean_error(tmp_path):
    """A bad flag value gives `Error: ...` and exit code 1, no traceback."""
    from qspec_cli.main import app

    result = CliRunner().invoke(
        app, ["bench", str(tmp_path), "--batch-sizes", "1,x", "--output", str(tmp_path / "out")]
    )
    assert result.exit_code == 1
    assert "Error: --batch-sizes '1,x'" in result.output  # the flag, not the field batch_sizes
    assert "Traceback" not in result.output


def test_options_from_flags(tmp_path):
    """None keeps the preset, per_category 0 means all, a draft package adds draft to the methods."""
    from qspec.bench import bench_options

    assert bench_options(per_category=None, turns=None) == quick_options()
    assert bench_options(per_category=0).per_category is None
    assert bench_options(full=True).batch_sizes == (1, 2, 4, 8)
    assert "draft" in bench_options(draft_package=tmp_path).methods
    assert bench_options(draft_package=tmp_path, methods="pld,draft").methods == ("pld", "draft")
    assert bench_options(weight_formats="int8").weight_formats == ("fp32", "int8")


def test_weight_formats_parse_with_fp32_first():
    """fp32 is always there and first (the other formats' reference); duplicates and blanks go; presets differ."""
    assert quick_options().weight_formats == ("fp32", "int4")
    assert full_options().weight_formats == ("fp32", "int8", "int4")
    assert BenchOptions.create(weight_formats="int4, fp32,int4,").weight_formats == ("fp32", "int4")
    assert BenchOptions.create(weight_formats=("int8",)).weight_formats == ("fp32", "int8")
    assert BenchOptions.create(weight_formats="fp32").weight_formats == ("fp32",)


def test_plan_quantized_formats_run_batch_1_variable_k_only():
    """int8 and int4 get none and every method's variable K lists at batch 1; fp32 keeps the whole grid."""
    options = full_options(methods="pld,suffix", k_lists="4;0,4;0,1,2,4,8")
    configs = [c for c in plan_configs(options) if not c.baseline]
    quantized = [c for c in configs if c.weight_format != "fp32"]
    assert {c.batch for c in quantized} == {1}
    assert [c.key for c in quantized if c.weight_format == "int8"] == [
        "none-int8@1",
        "pld[0,4]-int8@1",
        "pld[0,1,2,4,8]-int8@1",
        "suffix[0,4]-int8@1",
        "suffix[0,1,2,4,8]-int8@1",
    ]
    assert len([c for c in quantized if c.weight_format == "int4"]) == 5
    assert len([c for c in configs if c.weight_format == "fp32"]) == 4 * (1 + 2 * 3)  # 4 batch sizes
    assert len({c.key for c in configs}) == len(configs)  # every key names one configuration


def test_micro_targets_against_the_floor_and_the_small_bucket():
    """K=0 / K=4 against the floor in the full bucket (runtime graph); K=4 at 256 against K=4 at ctx_len on
    the vendor graph (explicit attention: the bucket bounds its reads), the runtime graph's ratio beside it."""
    from qspec.bench.report import MicroCall, MicroPackage, MicroReport

    _micro_targets = bench_targets()._micro_targets

    def call(name, ms):  # floor 20 ms
        return MicroCall(specialization=name, shape="", median_ms=ms, tokens_per_call=1, ratio_to_floor=ms / 20)

    calls = [call("K=0@256", 21.0), call("K=4@256", 24.0), call("K=0@1024", 22.0), call("K=4@1024", 32.0)]
    package = MicroPackage(batch=1, package="p", weight_bytes=1, floor_ms=20.0, iterations=1, calls=calls)
    vendor_calls = [call("K=4@256", 30.0), call("K=4@1024", 50.0)]
    vendor = MicroPackage(
        batch=1, graph="vendor", package="p", weight_bytes=1, floor_ms=20.0, iterations=1, calls=vendor_calls
    )
    targets = {t.target: t for t in _micro_targets(MicroReport(copy_bandwidth_gb_s=1.0, packages=[package, vendor]))}
    assert targets["K=0 call / weight-streaming floor (fp32, batch 1)"].status == "PASS"  # 22 / 20 = 1.10
    assert targets["K=4 call / weight-streaming floor (fp32, batch 1)"].status == "MISS"  # 32 / 20 = 1.60
    bucket = targets["K=4 call, bucket 256 / bucket 1024, positions < 256 (fp32, vendor graph)"]
    assert bucket.status == "PASS" and bucket.measured.startswith("0.60 x")  # 30 / 50
    assert "runtime graph 0.75 x" in bucket.measured  # 24 / 32
    without_vendor = _micro_targets(MicroReport(copy_bandwidth_gb_s=1.0, packages=[package]))
    assert not any(t.target.startswith("K=4 call, bucket") for t in without_vendor)
    assert _micro_targets(None) == []


def test_ceiling_replays_prompt_lookup_drafts_along_the_output():
    """Each decode position gets (drafts on offer, accepted): the 1-gram [1] continues [2, 3, 4, 9], of
    which the output [2, 3, 4, 7] takes 3; one token on, the 2-gram [1, 2] continues [3, 4, 9, 1] (2)."""
    from qspec.bench.ceiling import accepted_depth, replay_drafts

    assert accepted_depth([5, 6, 9], [1, 5, 6, 7], 1) == 2
    steps = replay_drafts("pld", {"a": [5, 1, 2, 3, 4, 9]}, {"a": [1, 2, 3, 4, 7]}, 4)
    assert steps == {"a": [(4, 3), (4, 2), (4, 1), (4, 0)]}


def test_ceiling_oracle_takes_the_cheapest_path():
    """The module docstring's example: K=0 10 ms, K=4 15 ms; drafts 3 deep at position 0, none after:
    a 3-draft call (13.75 ms, linear between the Ks) and one K=0 call, 23.75 ms against 50."""
    from qspec.bench.ceiling import call_ms, oracle_ms

    price = {0: 10.0, 4: 15.0}
    assert call_ms(price, 3) == 13.75 and call_ms(price, 4) == 15.0 and call_ms({0: 10, 4: 18}, 1) == 12.0
    steps = [(4, 3), (4, 0), (4, 0), (4, 0), (4, 0)]
    assert oracle_ms(steps, price, 4) == (23.75, 2)
    assert oracle_ms(steps, price, 0) == (50.0, 5)  # K list [0]: no draft is verified
    # drafts that would all be rejected never pay: the oracle is never slower than none
    assert oracle_ms([(4, 0)] * 6, price, 4) == (60.0, 6)
    # a shallower cap: 2 of the 3 accepted drafts, then K=0 calls for the last two positions
    assert oracle_ms(steps, price, 2) == (12.5 + 10 + 10, 3)


def test_a_batch_ceiling_is_bounded_by_the_share_of_a_call_drafts_save():
    """The module docstring's batch-4 example: K=0 16 ms, K=4 56 ms for four rows; a row accepting every draft
    verifies four a call (14 ms for five tokens against 4 ms each), 1.43x; past any depth the bound is 16 / (4 x 2.5)
    = 1.6x."""
    from qspec.bench.ceiling import oracle_ms

    price = {0: 16.0, 4: 56.0}
    ms, calls = oracle_ms([(4, 4)] * 100, price, 4)
    assert calls == 20 and round(100 * 16 / ms, 2) == 1.43
    deep = {0: 16.0, 1000: 16.0 + 1000 * 10.0}  # a K without end, the same 2.5 ms a row a verified draft
    ms, _ = oracle_ms([(1000, 1000 - i) for i in range(1000)], deep, 1000)
    assert 1.59 < 1000 * 16 / ms <= 1.6


def test_report_has_the_speculation_ceiling(bench_run):
    """Every pld configuration gets a ceiling row over its format's none at its batch size (batch 2 at the batch-2
    package's prices): the oracle may always verify nothing, so the ceiling is at least 1; its positions are none's
    first-turn decode tokens at that batch size."""
    out, report, _ = bench_run
    rows = {c.key: c for c in report.ceilings}
    assert set(rows) == {"pld[4]@1", "pld[0,4]@1", "pld[0,4]-int4@1", "pld[4]@2", "pld[0,4]@2"}
    for key, row in rows.items():
        none = ("none-int4@" if "int4" in key else "none@") + key.split("@")[1]
        first_turns = [tokens for rid, tokens in report.outputs[none].items() if "/" not in rid]
        assert row.positions == sum(len(tokens) - 1 for tokens in first_turns)
        assert row.oracle_x_none >= 1.0 and row.oracle_calls <= row.positions
        assert row.drafted_positions <= row.positions and row.measured_x_none > 0
    assert "## Speculation ceiling" in (out / "report.md").read_text()
