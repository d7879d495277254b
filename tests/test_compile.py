"""qspec.compile and the manifest it writes, on a tiny random model: checks that fail, manifests of older qspec."""

from __future__ import annotations

import json
import shutil

import onnxruntime
import pytest

from qspec.backends.ort_compile import check_ort
from qspec.compile import CompileOptions, compile_package
from qspec.errors import CompileError
from qspec.package import MANIFEST, ONNX_FILE, read_manifest, runtime_graph_file
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


def test_a_moved_package_runs_on_its_own(package, tmp_path):
    """A package's weights are links to the export's, and a copy of the folder elsewhere is a whole package:
    it runs, with the original removed, and generates what the original generates."""
    from qspec.runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=6)
    assert (package / ONNX_FILE).with_suffix(".onnx.data").stat().st_nlink >= 2
    original = Engine(package).generate([[5, 6, 7]], params)[0].token_ids
    moved = tmp_path / "moved"
    shutil.copytree(package, moved)
    stash = tmp_path / "stash"
    package.rename(stash)
    try:
        assert Engine(moved).generate([[5, 6, 7]], params)[0].token_ids == original
    finally:
        stash.rename(package)


def test_manifest_of_an_older_qspec_still_loads(package, tmp_path):
    """A manifest with the top-level weight_format and each check's `ok` (older qspec) reads as before."""
    raw = json.loads((package / MANIFEST).read_text())
    raw["weight_format"] = "fp32"
    for check in raw["ort_checks"]:
        check["ok"] = True
    old = tmp_path / "old"
    old.mkdir()
    (old / MANIFEST).write_text(json.dumps(raw))
    manifest = read_manifest(old)
    assert manifest.weight_format == "fp32" and manifest == read_manifest(package)


def test_check_fails_in_one_line_when_a_specialization_gives_other_logits(package):
    """Logits of another shape than the specialization's fail the check, naming the specialization."""
    manifest = read_manifest(package)
    with pytest.raises(CompileError, match=r"gave logits of shape .* expected") as caught:
        check_ort(
            package / runtime_graph_file(manifest),
            manifest.specializations,
            manifest.model.vocab_size + 1,
            progress=lambda message: None,
        )
    assert "\n" not in str(caught.value)


def test_check_fails_in_one_line_when_a_specialization_does_not_run(package, monkeypatch):
    """An ONNX Runtime failure while running a specialization is a one-line CompileError naming it."""
    manifest = read_manifest(package)

    def fail(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code\nstack trace ...")

    monkeypatch.setattr(onnxruntime.InferenceSession, "run", fail)
    with pytest.raises(CompileError, match=r"could not run specialization .*RUNTIME_EXCEPTION") as caught:
        check_ort(
            package / runtime_graph_file(manifest),
            manifest.specializations,
            manifest.model.vocab_size,
            progress=lambda message: None,
        )
    assert "\n" not in str(caught.value)


def test_an_ort_package_ships_the_vendor_graph_only_when_asked(tiny_model, package, tmp_path):
    """An ort package holds no model.onnx (an fp32 one keeps model.onnx.data, which its runtime graph reads);
    --vendor-graph adds it, under another inputs key; running the vendor graph of a package without it is a
    one-line error naming the flag."""
    from qspec.errors import PackageError
    from qspec.package import check_package
    from qspec.runtime.model import CompiledModel

    assert not (package / ONNX_FILE).exists() and (package / (ONNX_FILE + ".data")).is_file()
    assert not check_package(package).vendor_graph
    with pytest.raises(PackageError, match="holds no model.onnx.*--vendor-graph"):
        CompiledModel(package, vendor_graph=True)
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=32)
    options = CompileOptions(specialization=config, vendor_graph=True)
    folder, manifest, _ = compile_package(tiny_model("llama"), options, output=tmp_path / "with-vendor")
    assert manifest.vendor_graph and (folder / ONNX_FILE).is_file()
    assert manifest.inputs_key != read_manifest(package).inputs_key
    assert CompiledModel(folder, vendor_graph=True).manifest.vendor_graph


def test_info_measures_bytes_on_disk_and_resident_memory_after_load(package):
    """`qspec info --memory` loads the package in a child process: its load adds at least the KV buffers, which
    are 2 x layers x [1, kv heads, ctx_len + slack for the longest call, head_dim] fp32; the files' bytes add up."""
    from qspec.package_info import package_info

    info = package_info(package, memory=True)
    manifest = read_manifest(package)
    model = manifest.model
    slots = manifest.config.ctx_len + manifest.runtime_graph.kv_slack(max(s.seq_len for s in manifest.specializations))
    assert info.resident.kv_bytes == 2 * model.num_layers * model.num_kv_heads * slots * model.head_dim * 4
    assert info.resident.load_bytes > info.resident.kv_bytes and info.resident.process_bytes > info.resident.load_bytes
    assert info.total_bytes == sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
