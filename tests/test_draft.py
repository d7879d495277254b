"""Draft-model proposer: greedy output unchanged, draft KV kept consistent, sampling, config errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.errors import ConfigError
from qspec.runtime.draft import DraftProposer, cached_prefix
from qspec.runtime.engine import Engine
from qspec.runtime.sampling import SamplingParams
from qspec.specializations import make_config
from tests.conftest import VOCAB

CTX = 64
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [9, 10, 11, 12, 13, 9, 10, 11],
    [20, 21, 22] * 5,
    list(range(30, 60)),
    [40],
]
SLOTS = 3


def compile_tiny(model, folder, ks, *, layers=None, fbs=None, batch_size=1):
    config = make_config(
        num_speculative_tokens=ks, prefill_seq_len=8, ctx_len=CTX, full_batch_size=fbs, batch_size=batch_size
    )
    return compile_package(model, CompileOptions(specialization=config, num_layers=layers), output=folder)[0]


# name -> (Ks, num_layers, full_batch_size, batch_size). Three exports in all: the whole model with
# and without continuous batching, and its first layer (the weak draft) without.
PACKAGES = {
    "target": ("0,2,4", None, None, 1),
    "target_cb": ("0,2,4", None, SLOTS, 1),
    "draft": ("0", 1, None, 1),
    "draft_b3": ("0", 1, None, SLOTS),  # not continuous batching: one KV row per call row
    "same": ("0", None, None, 1),  # the target itself as the draft
    "same_cb": ("0", None, SLOTS, 1),
    "no_k0": ("2", None, None, 1),
}


@pytest.fixture(scope="module")
def packages(tiny_model, tmp_path_factory):
    """``packages[name]``: a tiny llama compiled as in PACKAGES, on first use (once per module)."""
    model = tiny_model("llama")
    root = tmp_path_factory.mktemp("draft-packages")

    class Packages(dict):
        def __missing__(self, name):
            ks, layers, fbs, batch_size = PACKAGES[name]
            self[name] = compile_tiny(model, root / name, ks, layers=layers, fbs=fbs, batch_size=batch_size)
            return self[name]

    return Packages()


def generate(package, method, prompts=PROMPTS, params=None, **options):
    engine = Engine(package, method=method, **options)
    params = params or [SamplingParams(max_new_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    return [o.token_ids for o in outputs], outputs, engine


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def test_cached_prefix_docstring_example():
    """The cache keeps the common prefix of what it holds and the new history, minus the newest token."""
    cached = [0, 1, 2, 3, 4, 51, 52]  # prompt p0..p4, then drafts d1, d2 were fed
    assert cached_prefix(cached, [0, 1, 2, 3, 4, 51, 99]) == 6  # d2 rejected, bonus 99: b pending
    assert cached_prefix(cached, [0, 1, 2, 3, 4, 51, 52, 53, 99]) == 7  # all accepted: d3, 99 pending
    assert cached_prefix(cached, [0, 1, 2, 3, 4, 51, 52]) == 6  # the newest token is always fed again
    assert cached_prefix([], [7]) == 0
    assert cached_prefix([0, 1, 9], [0, 1, 2, 3]) == 2


# --------------------------------------------------------------------------------------------
# Greedy: the target's output, whatever the draft
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cb", [False, True], ids=["batch1", "fbs3"])
def test_greedy_draft_equals_plain_greedy(packages, cb):
    """Method draft (a 1-layer draft) emits exactly plain greedy's tokens, batch 1 and with 3 slots.

    With 3 slots the target runs continuous batching and the draft a 3-row batch without it.
    """
    target, draft = (packages["target_cb"], packages["draft_b3"]) if cb else (packages["target"], packages["draft"])
    plain, _, _ = generate(target, "none")
    drafted, _, _ = generate(target, "draft", draft_package=draft)  # the default dispatch
    assert drafted == plain
    covered, _, engine = generate(target, "draft", draft_package=draft, dispatch="cover")  # every draft verified
    assert covered == plain
    assert engine.last_metrics.proposed > 0


@pytest.mark.parametrize("prefill_min_tokens", [1, 3, 1000], ids=["all-prefill", "default", "all-decode"])
@pytest.mark.parametrize("cb", [False, True], ids=["batch1", "fbs3"])
def test_same_model_draft_accepts_everything(packages, cb, prefill_min_tokens):
    """A draft that is the target itself is always right: acceptance 1, K + 1 tokens per call.

    Every step proposes min(4, remaining - 1) drafts, so a request of N tokens (1 from prefill)
    takes ceil((N - 1) / 5) target calls; any draft KV inconsistency would break this.
    """
    target, draft = (packages["target_cb"], packages["same_cb"]) if cb else (packages["target"], packages["same"])
    plain, _, _ = generate(target, "none")
    # cover dispatch: every step verifies all its drafts (auto's cost mode may cut them, by measured timings)
    drafted, outputs, engine = generate(
        target, "draft", draft_package=draft, prefill_min_tokens=prefill_min_tokens, dispatch="cover"
    )
    assert drafted == plain
    assert engine.last_metrics.acceptance_rate == 1.0
    for out in outputs:
        n = len(out.token_ids)
        assert out.metrics.target_calls == math.ceil((n - 1) / 5), out.metrics.to_dict()
        assert out.metrics.proposed == out.metrics.accepted == n - 1 - out.metrics.target_calls
        assert out.metrics.calls_per_k.get(4, 0) >= (n - 1) // 5


@pytest.mark.parametrize("cb", [False, True], ids=["batch1", "fbs3"])
def test_drafting_up_to_the_context_end(packages, cb):
    """Requests that run into ctx_len: drafts are cut so no position reaches it, output unchanged."""
    target, same = (packages["target_cb"], packages["same_cb"]) if cb else (packages["target"], packages["same"])
    prompts = [list(range(3, 3 + CTX - 9)), list(range(100, 100 + CTX - 12))]
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True)] * 2
    plain, outputs, _ = generate(target, "none", prompts, params)
    # cover: every draft verified, up to the cut (the default may price a tiny model's drafts out)
    drafted, _, engine = generate(target, "draft", prompts, params, draft_package=same, dispatch="cover")
    assert drafted == plain
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert [len(p) + len(t) for p, t in zip(prompts, plain)] == [CTX + 1, CTX + 1]  # the last token has no slot
    assert engine.last_metrics.acceptance_rate == 1.0


@pytest.mark.parametrize("force_accept", [0, 1, 3])
def test_rollback_after_partial_acceptance(packages, force_accept):
    """Forced partial acceptance of a same-model draft still emits greedy tokens: the draft rolls back.

    Accepted drafts are emitted unchecked, so they equal the target's argmax only if the draft KV
    is right after every rollback to the accepted prefix.
    """
    plain, _, _ = generate(packages["target_cb"], "none")
    drafted, _, engine = generate(
        packages["target_cb"], "draft", draft_package=packages["same_cb"], force_accept=force_accept
    )
    assert drafted == plain
    assert engine.last_metrics.accepted > 0 or force_accept == 0


def test_confidence_threshold_drops_unsure_drafts(packages):
    """Threshold 1: no draft is sure enough, nothing is proposed and every call is K = 0."""
    plain, _, _ = generate(packages["target"], "none")
    drafted, _, engine = generate(
        packages["target"], "draft", draft_package=packages["draft"], draft_confidence_threshold=1.0
    )
    assert drafted == plain
    assert engine.last_metrics.proposed == 0
    assert engine.last_metrics.calls["2"] == engine.last_metrics.calls["4"] == 0


def test_propose_single_matches_batch(packages):
    """propose() drafts the same tokens as propose_batch() and respects the cap."""
    proposer = DraftProposer(packages["same_cb"])  # continuous batching: prefill rows pick slots
    for i, prompt in enumerate(PROMPTS[:2]):
        proposer.start(i, prompt)
    batch = proposer.propose_batch([(0, 3), (1, 2)])
    assert [len(p) for p in batch] == [3, 2]
    assert all(p.probs is None for p in batch)  # greedy: point masses
    proposer.extend(0, [])  # nothing emitted: the cache rolls back to the history
    proposer.extend(1, [])
    assert proposer.propose(0, 3).tolist() == batch[0].tokens.tolist()
    assert proposer.propose(1, 0).size == 0


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def test_sampled_draft_is_reproducible(packages):
    """Sampling with a seed gives the same tokens twice; another seed gives other tokens."""

    def run(seed):
        params = [
            SamplingParams(temperature=0.9, top_k=50, seed=seed + i, max_new_tokens=16, ignore_eos=True)
            for i in range(4)
        ]
        target, draft = packages["target_cb"], packages["draft_b3"]
        tokens, _, engine = generate(target, "draft", PROMPTS[:4], params, draft_package=draft)
        return tokens, engine.last_metrics

    first, metrics = run(1)
    again, _ = run(1)
    other, _ = run(100)
    assert first == again
    assert first != other
    assert 0.0 < metrics.acceptance_rate < 1.0


def test_sampled_same_model_draft_is_accepted(packages):
    """With q == p the min(1, p/q) rule accepts (almost) every draft: q reaches the engine."""
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30, ignore_eos=True)
    _, _, engine = generate(packages["target"], "draft", PROMPTS[:2], [params, params], draft_package=packages["same"])
    assert engine.last_metrics.acceptance_rate > 0.95, engine.last_metrics


def test_proposal_carries_the_sampling_distributions(packages):
    """A sampling draft's proposal has one normalized q per draft, with the drafted token in its support."""
    proposer = DraftProposer(packages["draft"])
    proposer.start("r", PROMPTS[0], SamplingParams(temperature=0.7, top_k=5, seed=0))
    [proposal] = proposer.propose_batch([("r", 3)])
    drafts, q = proposal.tokens, proposal.probs
    assert q.shape == (3, proposer.model.vocab_size)
    np.testing.assert_allclose(q.sum(axis=1), 1.0)
    assert ((q > 0).sum(axis=1) <= 5).all()  # top-k
    assert (q[np.arange(3), drafts] > 0).all()


# --------------------------------------------------------------------------------------------
# Configuration errors
# --------------------------------------------------------------------------------------------


def test_too_few_draft_slots(packages):
    """A batch-1 draft cannot follow 3 sequences: the error names both counts and the fix."""
    with pytest.raises(ConfigError, match=r"1 KV slot\(s\) but the engine runs .*--full-batch-size"):
        generate(packages["target_cb"], "draft", draft_package=packages["draft"])
    with pytest.raises(ConfigError, match="--full-batch-size 3"):
        DraftProposer(packages["draft"], num_slots=3)


def test_different_vocabulary(packages):
    """A draft whose vocabulary is not the target's is refused, naming both sizes."""
    with pytest.raises(ConfigError, match=rf"vocabulary size {VOCAB} but the target has {VOCAB + 16}"):
        DraftProposer(packages["draft"], target_vocab_size=VOCAB + 16)
    DraftProposer(packages["draft"], target_vocab_size=VOCAB, target_ctx_len=CTX, num_slots=1)  # fits


def test_short_draft_context_and_missing_k0(packages):
    """A draft with less context than the target, or without a seq_len=1 shape, is refused."""
    with pytest.raises(ConfigError, match=rf"ctx_len {CTX} < the target's ctx_len {2 * CTX}"):
        DraftProposer(packages["draft"], target_ctx_len=2 * CTX)
    with pytest.raises(ConfigError, match=r"decode Ks \[2\].*--num-speculative-tokens 0"):
        DraftProposer(packages["no_k0"])
