"""Compute-context-length buckets (qspec.ccl): qspec's rule, qaic-compile's rule as QEfficient applies it, auto."""

from __future__ import annotations

import pytest

from qspec.ccl import automatic_lists, ccl_lists, qefficient_lists, qspec_lists
from qspec.errors import ConfigError
from qspec.specializations import build_specializations, ccl_notes, make_config


def test_qspec_rule_adds_ctx_len():
    """qspec's rule: the given values plus ctx_len; a list not given is [ctx_len]."""
    lists = qspec_lists((512, 256), None, 1024)
    assert (lists.prefill, lists.decode, lists.changes) == ((256, 512, 1024), (1024,), ())


def test_qefficient_rule_raises_caps_and_separates():
    """ctx 1024, prefill [256], decode [256, 512]: both raised to 1024, the prefill one moved to 992, each said."""
    lists = qefficient_lists((256,), (256, 512), 1024, 32)
    assert (lists.prefill, lists.decode) == ((992,), (1024,))
    assert lists.changes == (
        "comp_ctx_lengths_prefill 256 raised to 1024 (QEfficient's smallest bucket is 1024)",
        "comp_ctx_lengths_decode 256 raised to 1024 (QEfficient's smallest bucket is 1024)",
        "comp_ctx_lengths_decode 512 raised to 1024 (QEfficient's smallest bucket is 1024)",
        "comp_ctx_lengths_prefill 1024 moved to 992: qaic-compile needs prefill and decode buckets distinct "
        "(QEfficient moves the prefill one down to a multiple of 32)",
    )


def test_qefficient_rule_moves_past_taken_values():
    """A moved prefill value skips values already taken: decode [4064, 4096] pushes prefill 4096 to 4032."""
    lists = qefficient_lists((4096,), (4064, 4096), 4096, 64)
    assert (lists.prefill, lists.decode) == ((4032,), (4064, 4096))


def test_qefficient_rule_shares_the_list_at_prefill_seq_len_1():
    """prefill_seq_len 1: prefill and decode shapes coincide, both lists are the union, nothing moves."""
    lists = qefficient_lists((1024,), (2048,), 4096, 1)
    assert lists.prefill == lists.decode == (1024, 2048, 4096)


def test_automatic_lists():
    """QEfficient's automatic lists: one value up to 4096, doubling from a ctx_len-dependent start beyond."""
    assert automatic_lists(4096, 32) == ([4096], [4096])
    assert automatic_lists(32768, 32) == ([4000, 8000, 16000, 32768], [4096, 8192, 16384, 32768])
    assert automatic_lists(24576, 32) == ([4000, 8000, 16000, 24576], [4096, 8192, 16384, 24576])
    with pytest.raises(ConfigError, match="need ctx_len a multiple of 1024 .* pass --ctx-len 1024"):
        automatic_lists(128, 32)


def test_auto_in_a_list_option_makes_both_lists():
    """`auto` as either list turns on QEfficient's automatic lists; giving the other list too is refused."""
    config = make_config(num_speculative_tokens="0,4", ctx_len=32768, comp_ctx_lengths_decode="auto")
    assert config.ccl_auto and config.comp_ctx_lengths
    assert config.buckets("decode") == [4096, 8192, 16384, 32768]
    with pytest.raises(ConfigError, match="comp_ctx_lengths_decode auto makes both lists; drop comp_ctx_lengths_pre"):
        make_config(num_speculative_tokens="0", comp_ctx_lengths_decode="auto", comp_ctx_lengths_prefill="1024")


def test_qefficient_rule_buckets_and_specializations():
    """Under the qaic rule the shapes carry the adjusted buckets: prefill at 992, decode at 1024."""
    config = make_config(
        num_speculative_tokens="0,4",
        ctx_len=1024,
        comp_ctx_lengths_prefill="256",
        comp_ctx_lengths_decode="256,512",
        ccl_rule="qefficient",
    )
    assert config.buckets("prefill") == [992] and config.buckets("decode") == [1024]
    assert [(s.seq_len, s.comp_ctx_lengths) for s in build_specializations(config)] == [(32, 992), (1, 1024), (5, 1024)]


def test_qefficient_rule_bucket_too_small_for_prefill():
    """A moved prefill bucket below prefill_seq_len is refused, saying what moved it."""
    with pytest.raises(ConfigError, match=r"prefill bucket 96 < prefill_seq_len 128 \(.*moved to 96"):
        make_config(num_speculative_tokens="0", ctx_len=128, prefill_seq_len=128, comp_ctx_lengths_decode="128",
                    ccl_rule="qefficient")  # fmt: skip


def test_ccl_notes_count_and_warning():
    """The notes repeat the rule's changes and warn past QEfficient's 10 CCL shapes (K x decode buckets)."""
    config = make_config(
        num_speculative_tokens="0,1,2,4",
        ctx_len=8192,
        comp_ctx_lengths_prefill="2048",
        comp_ctx_lengths_decode="1024,4096",
        ccl_rule="qefficient",
    )
    specs = build_specializations(config)
    notes = ccl_notes(config, specs)
    assert notes[0] == (
        "comp_ctx_lengths_prefill 8192 moved to 8160: qaic-compile needs prefill and decode buckets distinct "
        "(QEfficient moves the prefill one down to a multiple of 32)"
    )
    assert notes[1].startswith("14 specializations (2 prefill buckets, 4 K x 3 decode buckets): QEfficient's")
    assert ccl_notes(make_config(num_speculative_tokens="0,4"), []) == []


def test_ccl_lists_auto_needs_no_list():
    """auto with lists given uses the lists (QEfficient's process_ccl_specializations does the same)."""
    lists = ccl_lists("qefficient", (2048,), None, ctx_len=8192, prefill_seq_len=32, auto=True)
    assert (lists.prefill, lists.decode) == ((2048, 8160), (8192,))
