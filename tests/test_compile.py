"""qspec.compile and the manifest it writes, on a tiny random model."""

from __future__ import annotations

import json

import pytest

from qspec.compile import CompileOptions, compile_package
from qspec.package import MANIFEST, read_manifest
from qspec.specializations import make_config


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    """A package of a tiny llama, Ks [0,4]."""
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=32)
    folder, _, _ = compile_package(
        tiny_model("llama"), CompileOptions(specialization=config), output=tmp_path_factory.mktemp("k04") / "p"
    )
    return folder


def test_weight_format_is_recorded_once(package):
    """The manifest records the weight format in its runtime graph only; Manifest.weight_format reads it there."""
    raw = json.loads((package / MANIFEST).read_text())
    assert "weight_format" not in raw and raw["runtime_graph"]["weight_format"] == "fp32"
    assert read_manifest(package).weight_format == "fp32"


def test_manifest_of_an_older_qspec_still_loads(package, tmp_path):
    """A manifest with the top-level weight_format (older qspec) reads as before."""
    raw = json.loads((package / MANIFEST).read_text())
    raw["weight_format"] = "fp32"
    old = tmp_path / "old"
    old.mkdir()
    (old / MANIFEST).write_text(json.dumps(raw))
    manifest = read_manifest(old)
    assert manifest.weight_format == "fp32" and manifest == read_manifest(package)
