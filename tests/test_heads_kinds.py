"""The seam of head kinds: one table of kinds (compile side), one of proposers (runtime side), and the layering
between them (the runtime reads the head manifest without importing the compile side or torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_every_kind_names_a_runtime_proposer_and_the_cli_methods_derive_from_it():
    pytest.importorskip("torch")
    from qspec.heads.kinds import KINDS
    from qspec.runtime.heads import HEAD_PROPOSERS
    from qspec.runtime.proposers import HEAD_METHODS, METHOD_ALIASES

    order = list(KINDS)  # detection order: the more specific first
    assert order.index("turbo") < order.index("medusa") and order.index("eagle3") < order.index("eagle")
    assert {kind.method for kind in KINDS.values()} <= set(HEAD_PROPOSERS)
    assert set(HEAD_METHODS) == set(HEAD_PROPOSERS) | {f"{m}+pld" for m in HEAD_PROPOSERS}
    assert METHOD_ALIASES["eagle3"] == "eagle" and METHOD_ALIASES["eagle3+pld"] == "eagle+pld"


def test_serve_options_accept_the_alias():
    from qspec_cli.serve import method_options

    knobs = dict(prompt_lookup_min=1, prompt_lookup_max=3, draft_package=None, draft_confidence_threshold=0.3)
    assert method_options("eagle3+pld", **knobs) == {
        "draft_confidence_threshold": 0.3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


def test_the_runtime_imports_neither_the_compile_side_nor_torch():
    """qspec.runtime.heads reads qspec.head_manifest (beside qspec.package), not qspec.heads."""
    code = (
        "import sys, qspec.runtime.heads, qspec.runtime.proposers; "
        "bad = sorted(m for m in sys.modules if m.startswith('qspec.heads') or m == 'torch'); "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_an_unknown_head_method_is_a_one_line_error():
    from qspec.errors import ConfigError
    from qspec.runtime.heads import head_proposer

    with pytest.raises(ConfigError, match="unknown head method 'nonesuch'"):
        head_proposer("nonesuch")


def test_the_cli_method_choices_are_the_runtimes():
    """The CLI's static choices (a Literal for Typer) are the runtime's methods and aliases, no more, no less."""
    from typing import get_args

    from qspec_cli.common import Method

    from qspec.runtime.proposers import METHOD_ALIASES, PROPOSER_METHODS

    assert set(get_args(Method)) == (set(PROPOSER_METHODS) - {"user"}) | set(METHOD_ALIASES)
