"""New methods through the seams alone: a toy compile backend (one entry of ``BACKENDS``) and a toy head kind (one
entry of ``KINDS``) compile a real tiny model into a package the engine runs, with no other module touched."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from qspec.backends.base import CompileBackend  # noqa: E402
from qspec.backends.registry import BACKENDS  # noqa: E402
from qspec.heads import kinds, modules  # noqa: E402
from qspec.heads.eagle import EagleKind  # noqa: E402

TOY_FILE = "toy_compile.txt"


class ToyBackend(CompileBackend):
    """Ships the vendor graph (the runtime loads ``model.onnx``) and writes its own file for each program."""

    name = "toy"
    ships_vendor_graph = True

    def prepare(self, folder, exported, graph, options, *, progress):
        (folder / TOY_FILE).write_text(f"{len(exported.specs)} specializations\n")
        return {}

    def prepare_head(self, programs, kind, manifest, options, *, progress):
        for folder in programs:
            (folder / TOY_FILE).write_text(f"{kind.layout} head, {len(manifest.specializations)} specializations\n")
        return manifest


class ToyKind(EagleKind):
    """An EAGLE-1 checkpoint marked by a ``toy.json``: drafts as EAGLE, detected before every other kind."""

    layout = "toy-eagle"
    expects = "a toy.json beside an EAGLE-1 checkpoint"

    def detect(self, folder: Path, config: dict | None) -> bool:
        return (folder / "toy.json").is_file()


def test_a_toy_backend_and_head_kind_compile_and_run_through_the_tables(tiny_model, tmp_path, monkeypatch):
    """compile_package with backend "toy" and a toy head: the backend's files in the package and the head's
    program, both manifests name them, and the engine's EAGLE drafts leave greedy output as plain greedy's."""
    from transformers import AutoModelForCausalLM

    from qspec.compile import CompileOptions, compile_package
    from qspec.head_manifest import HEAD_DIR, read_head_manifest
    from qspec.runtime import Engine, SamplingParams
    from qspec.specializations import make_config

    monkeypatch.setitem(BACKENDS, "toy", ToyBackend())
    monkeypatch.setattr(kinds, "KINDS", {"toy-eagle": ToyKind(), **kinds.KINDS})
    model_dir = tiny_model("llama")
    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    modules.save_eagle(modules.eagle_from_target(target), tmp_path / "head")
    (tmp_path / "head" / "toy.json").write_text("{}\n")
    options = CompileOptions(
        specialization=make_config(num_speculative_tokens="0,2", prefill_seq_len=8, ctx_len=64),
        backend="toy",
        draft_head=str(tmp_path / "head"),
    )
    package, manifest, reused = compile_package(model_dir, options, output=tmp_path / "pkg")

    assert (manifest.backend, manifest.runtime_graph, reused) == ("toy", None, False)
    assert (package / TOY_FILE).read_text() == f"{len(manifest.specializations)} specializations\n"
    assert (package / "model.onnx").is_file()  # what a vendor backend compiles
    head = read_head_manifest(package)
    assert (head.layout, head.backend, head.weight_format) == ("toy-eagle", "toy", "fp32")
    assert (package / HEAD_DIR / TOY_FILE).read_text().startswith("toy-eagle head")
    prompt = [[1, 5, 9, 5, 9, 5, 9, 2]]
    params = SamplingParams(max_new_tokens=12)
    plain = Engine(package, method="none").generate(prompt, params)[0].token_ids
    assert Engine(package, method="eagle").generate(prompt, params)[0].token_ids == plain


def test_an_unknown_backend_is_a_one_line_error():
    from qspec.compile import CompileOptions
    from qspec.errors import ConfigError
    from qspec.specializations import make_config

    with pytest.raises(ConfigError, match="unknown backend 'nonesuch': use one of ort, qaic"):
        CompileOptions.create(specialization=make_config(num_speculative_tokens="0,4"), backend="nonesuch")
