"""``qspec bench --draft-head``: head methods beside pld on a tiny random model, the per-position acceptance,
the head's call costs, the head methods' options and errors, and the package names."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qspec.bench import BenchReport, bench_options, plan_configs, quick_options, render_markdown
from qspec.bench.packages import package_name, resolve_model
from qspec.bench.peers.runners import PEER_MODULES
from qspec.errors import ConfigError, QSpecError

PROMPTS = [
    {"question_id": 1, "category": "code", "turns": ["x = 1; y = x + x; print(y) # rename x to z"]},
    {"question_id": 3, "category": "chat", "turns": ["Hello there, how are you today?"]},
]


def save_head(target_dir, out, method: str):
    """A random EAGLE-1 or Medusa head on the tiny target's tables, in its standard layout."""
    import torch
    from transformers import AutoModelForCausalLM

    from qspec.heads import modules

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    head = modules.eagle_from_target(target) if method == "eagle" else modules.medusa_from_target(target, 2)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in head.parameters():
            if param.requires_grad:
                param.normal_(0, 0.2)
    (modules.save_eagle if method == "eagle" else modules.save_medusa)(head, out)
    return out


@pytest.fixture(scope="module")
def eagle_dir(tiny_model, tmp_path_factory):
    return save_head(tiny_model("llama"), tmp_path_factory.mktemp("eagle") / "head", "eagle")


@pytest.fixture(scope="module")
def head_run(tiny_model, eagle_dir, tmp_path_factory):
    """A small run with an EAGLE head: batch 1 and 2, K list [0,4], fp32, memory probes, no baselines or peers."""
    from qspec_cli.main import app

    out = tmp_path_factory.mktemp("bench-heads")
    prompts = out / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    args = ["bench", str(tiny_model("llama")), "--draft-head", str(eagle_dir), "--output", str(out)]
    args += ["--prompts", str(prompts), "--per-category", "0", "--batch-per-category", "0", "--max-new-tokens", "12"]
    args += ["--batch-sizes", "1,2", "--k-lists", "0,4", "--weight-formats", "fp32", "--analysis"]
    args += ["--micro-iterations", "2", "--tree-widths", "1,2"]
    args += ["--prefill-chunk-sizes", "", "--ctx-len", "128", "--prefill-seq-len", "8", "--packages-dir"]
    args += [str(out / "packages"), "--comp-ctx-lengths-prefill", "", "--comp-ctx-lengths-decode", ""]
    args += ["--no-baselines", "--no-peers"]
    with pytest.MonkeyPatch.context() as patch:
        for peer in PEER_MODULES:
            patch.setitem(PEER_MODULES, peer, "qspec_tests_no_such_module")
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, BenchReport.model_validate_json((out / "report.json").read_text())


def test_head_methods_run_beside_pld_and_equal_none(head_run):
    """eagle and eagle+pld join the default methods at every batch size; their greedy outputs equal none's."""
    _, report = head_run
    keys = {s.key for s in report.configs}
    for batch in (1, 2):
        assert {f"none@{batch}", f"pld[0,4]@{batch}", f"eagle[0,4]@{batch}", f"eagle+pld[0,4]@{batch}"} <= keys
    assert report.meta.options.methods == ("pld", "suffix", "eagle", "eagle+pld")
    assert report.equality.speculative_equal_none is True
    assert all("-head" in folder for folder in report.meta.packages.values())
    # every configuration loads in its own process, heads too; the 1-vs-many comparison leaves heads out
    assert report.memory.probes["eagle+pld[0,4]@1"].peak_rss_mb > 0
    assert report.memory.many_config == "pld[0,4]@1"


def test_tree_width_runs_each_head_method_as_a_tree_at_batch_1(head_run):
    """--tree-widths 1,2 adds each head method with its runner-up beside the chain at batch 1 (trees are verified
    on a one-slot package), its greedy output equal to none's, and a target against its chain."""
    from tests.conftest import bench_targets

    _, report = head_run
    trees = sorted(s.key for s in report.configs if s.tree_width > 1)
    assert trees == ["eagle+pld-tree2[0,4]@1", "eagle-tree2[0,4]@1"]
    assert report.equality.speculative_equal_none is True
    targets = {t.target for t in bench_targets().evaluate_targets(report.configs, report.memory, report.micro)}
    assert "eagle-tree2[0,4]@1 vs its chain (eagle[0,4]@1)" in targets
    assert "eagle+pld-tree2[0,4]@1 vs the better alone (eagle-tree2[0,4]@1)" in targets or any(
        t.startswith("eagle+pld-tree2[0,4]@1 vs the better alone (pld[0,4]@1)") for t in targets
    )


def test_report_has_acceptance_per_position(head_run):
    """Every drafting configuration has per-position counts: draft 1 is reached at every call that verified one."""
    out, report = head_run
    eagle = report.config("eagle[0,4]@1").overall
    assert 0 < eagle.reached_per_position[0] <= eagle.sequence_calls  # cost dispatch verifies drafts that pay
    assert eagle.acceptance_per_position[0] == round(eagle.accepted_per_position[0] / eagle.reached_per_position[0], 4)
    assert eagle.tokens_per_drafted_call is not None
    assert report.config("none@1").overall.reached_per_position == []
    markdown = (out / "report.md").read_text()
    assert "## Acceptance per draft position" in markdown and "| eagle[0,4]@1 |" in markdown


def test_report_has_the_head_call_costs(head_run):
    """The micro-benchmark times every head specialization of each package, beside the target's K=0 call."""
    out, report = head_run
    heads = report.micro.heads
    assert [(h.batch, h.method) for h in heads] == [(1, "eagle"), (2, "eagle")]
    b1 = heads[0]
    # prefill (seq_len 8), then seq_len 1 (chain) and K + 1 = 5 (catch-up); batch 1 and 2 rows
    assert [c.specialization for c in b1.calls] == ["prefill", "seq_len=1", "seq_len=5"]
    assert all(c.median_ms > 0 for c in b1.calls) and b1.target_k0_ms > 0
    assert "batch_size=2" in heads[1].calls[1].shape
    assert "## Draft head calls" in (out / "report.md").read_text()


def test_options_add_the_heads_method(eagle_dir, tiny_model, tmp_path):
    """--draft-head without --methods adds the head's method and +pld (Medusa's for a Medusa folder); given
    methods stay as given."""
    assert bench_options(draft_head=eagle_dir).methods == ("pld", "suffix", "eagle", "eagle+pld")
    assert bench_options(draft_head=eagle_dir, methods="eagle").methods == ("eagle",)
    medusa = save_head(tiny_model("llama"), tmp_path / "medusa", "medusa")
    assert bench_options(draft_head=medusa).methods[-2:] == ("medusa", "medusa+pld")


def test_head_methods_run_where_pld_runs():
    """Head methods get every K list at every batch size (fp32) and the variable K lists at batch 1 (int4)."""
    options = quick_options(methods="pld,eagle", k_lists="4;0,4", draft_head="head")
    keys = [c.key for c in plan_configs(options) if not c.baseline]
    assert [k for k in keys if k.startswith("eagle")] == [
        "eagle[4]@1",
        "eagle[0,4]@1",
        "eagle[4]@4",
        "eagle[0,4]@4",
        "eagle[0,4]-int4@1",
    ]


def test_package_names_differ_with_a_head(eagle_dir, tmp_path):
    """The cache never mixes packages with and without a head, or with two heads."""
    plain = package_name("m.gguf", 1, (0, 4), quick_options())
    headed = package_name("m.gguf", 1, (0, 4), quick_options(methods="eagle", draft_head=eagle_dir))
    assert headed.startswith(plain + "-head") and headed != plain
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert package_name("m.gguf", 1, (0, 4), quick_options(methods="eagle", draft_head=other)) != headed


def test_head_method_errors(tiny_model, eagle_dir, head_run):
    """A head method needs --draft-head, the head's own method, and a compiled package's own head: one line each."""
    model = str(tiny_model("llama"))
    with pytest.raises(ConfigError, match="need --draft-head"):
        resolve_model(model, quick_options(methods="eagle", baselines=False, peers=False))
    with pytest.raises(ConfigError, match="is eagle: methods"):
        resolve_model(model, quick_options(methods="medusa", draft_head=eagle_dir, baselines=False, peers=False))
    with pytest.raises(ConfigError, match="name no head method"):
        quick_options(methods="pld", draft_head=eagle_dir)
    _, report = head_run
    given = report.meta.packages["1"]
    resolved = resolve_model(given, quick_options(methods="pld", baselines=False, peers=False))
    assert resolved.options.methods == ("pld", "eagle", "eagle+pld")  # the package's head runs
    with pytest.raises(ConfigError, match="applies to a model the bench compiles"):
        resolve_model(given, quick_options(methods="eagle", draft_head=eagle_dir, baselines=False, peers=False))


def test_cli_head_method_without_head_is_one_line(tiny_model, tmp_path):
    """`qspec bench MODEL --methods eagle` without --draft-head: `Error: ...`, exit 1, no traceback."""
    from qspec_cli.main import app

    args = ["bench", str(tiny_model("llama")), "--methods", "eagle", "--no-baselines", "--no-peers"]
    result = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Error:" in result.output and "--draft-head" in result.output
    assert "Traceback" not in result.output
    assert issubclass(ConfigError, QSpecError)


def test_markdown_renders_without_head_sections_for_an_old_report(head_run):
    """A report without heads or per-position counts renders without those sections."""
    _, report = head_run
    plain = report.model_copy(update={"micro": None, "configs": [report.config("none@1")]})
    markdown = render_markdown(plain)
    assert "## Acceptance per draft position" not in markdown and "## Draft head calls" not in markdown


def test_report_has_a_head_ceiling_replayed_on_hidden_states(head_run):
    """eagle and eagle+pld at batch 1 and 2 get a ceiling replayed on the target's hidden states (batch 2 on the
    batch-2 package, along its none's outputs); pld keeps its token replay; the EAGLE head drafts at every position
    (its first draft is taken whatever its confidence)."""
    out, report = head_run
    rows = {c.key: c for c in report.ceilings}
    for batch in (1, 2):
        assert rows[f"pld[0,4]@{batch}"].replay == "tokens"
        eagle = rows[f"eagle[0,4]@{batch}"]
        assert (eagle.replay, rows[f"eagle+pld[0,4]@{batch}"].replay) == ("hidden states", "hidden states")
        assert eagle.drafted_positions == eagle.positions > 0
        assert eagle.oracle_x_none > 0
    assert "replay: hidden states" in (out / "report.md").read_text()


def test_head_draft_costs_and_the_oracle_pays_them():
    """EAGLE pays one head call per draft, Medusa one per step, lookup nothing; the oracle adds it to the call."""
    from qspec.bench.ceiling import head_draft_ms, oracle_ms

    assert head_draft_ms("eagle", 2.0, 3, True) == (0.0, 2.0, 4.0, 6.0)
    assert head_draft_ms("medusa", 2.0, 2, True) == (0.0, 2.0, 2.0)
    assert head_draft_ms("eagle", 2.0, 2, False) == (0.0, 0.0, 0.0)
    steps = [(1, 1), (1, 0)]  # position 0: one draft, accepted; position 1: one draft, rejected
    price = {0: 10.0, 1: 12.0}
    assert oracle_ms(steps, price, 1) == (12.0, 1)  # one K=1 call covers both positions
    # a draft that costs 5 ms more than it saves: two K=0 calls instead
    assert oracle_ms(steps, price, 1, [(0.0, 9.0), (0.0, 9.0)]) == (20.0, 2)


def test_replay_feeds_hidden_states_as_the_engine_does():
    """The prompt's hidden states before the first step, then position p's once the token after it is out."""
    import numpy as np

    from qspec.bench.ceiling import replay
    from qspec.runtime.proposal import Proposal, Proposer

    class Recorder(Proposer):
        wants_hidden_states = True

        def __init__(self):
            self.seen, self.known = [], 0

        def start(self, request_id, prompt_tokens, params=None, rng=None):
            self.tokens = list(prompt_tokens)

        def observe_hidden(self, request_id, start, hidden):
            assert start == self.known, (start, self.known)
            self.known = start + len(hidden)

        def extend(self, request_id, new_tokens):
            self.tokens += list(new_tokens)

        def propose(self, request_id, k):
            self.seen.append((len(self.tokens), self.known))
            return np.asarray([self.tokens[-1]], np.int64)  # drafts a repeat of the last token

        def propose_batch(self, items):
            return [Proposal(self.propose(rid, k)) for rid, k in items]

        def finish(self, request_id):
            pass

    proposer = Recorder()
    hidden = {"a": np.zeros((5, 4), np.float32)}  # prompt 3 + output 3 - 1 positions
    steps = replay(proposer, {"a": [1, 2, 3]}, {"a": [7, 7, 8]}, 4, hidden)
    # each step: tokens known = prompt + emitted, hidden states known for all but the newest token
    assert proposer.seen == [(4, 3), (5, 4)]
    assert steps["a"] == [((1, 1), 0), ((1, 0), 0)]  # 7 repeats 7 (accepted), then 7 is not 8


class Recording:
    """A proposer wrapper that records, per request, the drafts proposed when the request held n tokens."""

    def __init__(self, inner):
        from qspec.runtime.proposal import Proposer

        class Wrapped(Proposer):
            wants_hidden_states = inner.wants_hidden_states

            def check_target(s, **kwargs):
                inner.check_target(**kwargs)

            def start(s, rid, prompt, params=None, rng=None):
                self.length[rid] = len(prompt)
                inner.start(rid, prompt, params, rng)

            def observe_hidden(s, rid, start, hidden):
                inner.observe_hidden(rid, start, hidden)

            def extend(s, rid, tokens):
                self.length[rid] += len(tokens)
                inner.extend(rid, tokens)

            def finish(s, rid):
                inner.finish(rid)

            def propose(s, rid, k):
                return s.propose_batch([(rid, k)])[0].tokens

            def propose_batch(s, items):
                out = inner.propose_batch(items)
                for (rid, _), proposal in zip(items, out):
                    self.drafts.setdefault(rid, {})[self.length[rid]] = proposal.tokens.tolist()
                return out

        self.length: dict = {}
        self.drafts: dict = {}
        self.proposer = Wrapped()


def test_replayed_head_drafts_are_the_runs_drafts(head_run):
    """Along none's output, the replay proposes at every position what the run proposed at its call starts:
    the head's drafts depend on tokens and hidden states only, both the same in a run and in the replay."""
    from qspec.bench.ceiling import replay, target_hidden_states
    from qspec.runtime import Engine, SamplingParams
    from qspec.runtime.proposers import make_proposer

    _, report = head_run
    package = report.meta.packages["1"]
    params = SamplingParams(max_new_tokens=16)
    prompts = {"a": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "b": list(range(30, 50)), "c": [100, 17, 3, 99, 250, 18]}
    none = Engine(package, method="none")
    outputs = {rid: list(none.generate([p], params)[0].token_ids) for rid, p in prompts.items()}
    run = Recording(make_proposer("eagle", package=package))
    engine = Engine(package, method="eagle", num_speculative_tokens=[4], dispatch="cover", proposer=run.proposer)
    for rid, prompt in prompts.items():
        assert list(engine.generate([prompt], params)[0].token_ids) == outputs[rid]
    ran = dict(zip(prompts, run.drafts.values()))  # the engine numbers its requests itself, in order
    hidden = {rid: target_hidden_states(none.model, prompts[rid], outputs[rid]) for rid in prompts}
    replayed = Recording(make_proposer("eagle", package=package))
    replayed.proposer.check_target(vocab_size=none.model.vocab_size, ctx_len=none.model.ctx_len, num_slots=1)
    replay(replayed.proposer, prompts, outputs, 4, hidden)
    for rid in prompts:  # near max_new_tokens the engine asks for fewer drafts: the replay's start the same
        steps = ran[rid]
        assert len(steps) > 1 and all(replayed.drafts[rid][n][: len(d)] == d for n, d in steps.items()), rid
        assert sum(len(d) for d in steps.values()) > len(steps)  # chains, not only first drafts


def test_a_ceiling_of_one_captures_nothing(head_run):
    """A random head's drafts are never worth verifying: ceiling 1.000, and no share of a gain that is not there."""
    _, report = head_run
    for row in report.ceilings:
        assert row.captured is None or abs(row.captured) < 1e6, row
        if row.oracle_x_none <= 1.0:
            assert row.captured is None


@pytest.fixture(scope="module")
def medusa_package(tiny_model, tmp_path_factory):
    """A batch-1 package, K 0 and 4, with a random Medusa head (2 heads)."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.specializations import make_config

    root = tmp_path_factory.mktemp("medusa")
    head = save_head(tiny_model("llama"), root / "head", "medusa")
    spec = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=128)
    options = CompileOptions(specialization=spec, draft_head=str(head))
    package, _, _ = compile_package(str(tiny_model("llama")), options, output=root / "package")
    return package


def test_medusa_head_calls_are_timed_per_batch_size(medusa_package):
    """A Medusa head has one shape per row count (batch 1 here); the ceiling prices its step by that call."""
    from qspec.bench.ceiling import head_call_ms
    from qspec.bench.micro import head_micro_benchmark
    from qspec.bench.report import MicroReport

    head = head_micro_benchmark(medusa_package, 2, 1e10, batch=1, weight_format="fp32")
    assert (head.method, [c.specialization for c in head.calls]) == ("medusa", ["batch=1"])
    assert head.calls[0].median_ms > 0 and head.target_k0_ms is None  # no target micro-benchmark given
    micro = MicroReport(copy_bandwidth_gb_s=10.0, packages=[], heads=[head])
    assert head_call_ms(micro, "fp32") == ("medusa", head.calls[0].median_ms)
    assert head_call_ms(micro, "int4") is None


def test_replayed_medusa_drafts_are_the_runs_drafts(medusa_package):
    """Medusa reads the newest hidden state only: the replay proposes what the run proposed at its call starts."""
    from qspec.bench.ceiling import replay, target_hidden_states
    from qspec.runtime import Engine, SamplingParams
    from qspec.runtime.proposers import make_proposer

    params = SamplingParams(max_new_tokens=16)
    prompts = {"a": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "b": list(range(30, 50))}
    none = Engine(medusa_package, method="none")
    outputs = {rid: list(none.generate([p], params)[0].token_ids) for rid, p in prompts.items()}
    run = Recording(make_proposer("medusa", package=medusa_package))
    engine = Engine(
        medusa_package, method="medusa", num_speculative_tokens=[4], dispatch="cover", proposer=run.proposer
    )
    for prompt in prompts.values():
        engine.generate([prompt], params)
    ran = dict(zip(prompts, run.drafts.values()))
    hidden = {rid: target_hidden_states(none.model, prompts[rid], outputs[rid]) for rid in prompts}
    replayed = Recording(make_proposer("medusa", package=medusa_package))
    replayed.proposer.check_target(vocab_size=none.model.vocab_size, ctx_len=none.model.ctx_len, num_slots=1)
    replay(replayed.proposer, prompts, outputs, 4, hidden)
    for rid, steps in ran.items():
        assert len(steps) > 1 and all(replayed.drafts[rid][n][: len(d)] == d for n, d in steps.items()), rid


def test_a_heads_drafts_with_a_smaller_cap_are_a_prefix(head_run):
    """EAGLE's drafts capped at 2 are the first 2 of its drafts capped at 4, position by position, so one replay
    at the deepest K serves every K list; head_replays_of shares it between eagle's K lists."""
    from qspec.bench.analysis import Collected
    from qspec.bench.ceiling import head_replays_of, replay, target_hidden_states
    from qspec.bench.plan import RunConfig, none_config
    from qspec.bench.report import MicroCall, MicroHead, MicroReport
    from qspec.bench.runners import RequestResult
    from qspec.runtime import Engine, SamplingParams
    from qspec.runtime.metrics import RequestMetrics
    from qspec.runtime.proposers import make_proposer

    _, report = head_run
    package = report.meta.packages["1"]
    none = Engine(package, method="none")
    prompts = {"a": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}
    outputs = {"a": list(none.generate([prompts["a"]], SamplingParams(max_new_tokens=12))[0].token_ids)}
    hidden = {"a": target_hidden_states(none.model, prompts["a"], outputs["a"])}
    drafts = {}
    for cap in (2, 4):
        recording = Recording(make_proposer("eagle", package=package))
        recording.proposer.check_target(vocab_size=none.model.vocab_size, ctx_len=none.model.ctx_len, num_slots=1)
        replay(recording.proposer, prompts, outputs, cap, hidden)
        drafts[cap] = recording.drafts["a"]
    assert drafts[2] == {n: d[:2] for n, d in drafts[4].items()}

    collected = {none_config("fp32", 1).key: Collected(none_config("fp32", 1))}
    collected["none@1"].requests["a"] = ("chat", RequestResult(outputs["a"], "", RequestMetrics()))
    call = MicroCall(specialization="seq_len=1", shape="", median_ms=1.0, tokens_per_call=1, ratio_to_floor=1.0)
    head = MicroHead(
        batch=1, weight_format="fp32", method="eagle", package=package, weight_bytes=1, floor_ms=1.0, iterations=1,
        target_k0_ms=None, calls=[call],
    )  # fmt: skip
    micro = MicroReport(copy_bandwidth_gb_s=1.0, packages=[], heads=[head])
    configs = [RunConfig("eagle", (4,), 1), RunConfig("eagle", (0, 4), 1), RunConfig("eagle+pld", (0, 4), 1)]
    replays = head_replays_of(configs, {("fp32", 1): none.model}, collected, prompts, micro)
    assert replays["eagle[4]@1"] is replays["eagle[0,4]@1"] and "eagle+pld[0,4]@1" in replays


def test_targets_read_the_head_rows(head_run):
    """bench/targets.py holds head drafting to its own goal (fp32 1.5x none at batch 1, 1.3x at batch > 1) and
    the combined method to the better of its parts, with the report's numbers."""
    from tests.conftest import bench_targets

    _, report = head_run
    by_key = {s.key: s for s in report.configs}
    targets = {t.target: t for t in bench_targets().evaluate_targets(report.configs, report.memory, report.micro)}
    head = targets["eagle[0,4] vs none, requests/s (batch 1)"]
    assert head.goal == ">= 1.5 x none" and head.status in ("PASS", "MISS")
    assert head.measured == f"{by_key['eagle[0,4]@1'].overall.ratio_to_none:.3f} x"
    assert targets["eagle[0,4] vs none, requests/s (batch 2)"].goal == ">= 1.3 x none"
    combined = [t for name, t in targets.items() if name.startswith("eagle+pld[0,4]@1 vs the better alone")]
    assert len(combined) == 1 and combined[0].status in ("PASS", "MISS")
