"""Draft heads compiled into a package: ONNX Runtime equals the torch modules, specializations, vendor files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from qspec import contract, head_manifest  # noqa: E402
from qspec.backends import ort_plan  # noqa: E402
from qspec.errors import PackageError  # noqa: E402
from qspec.export.graph import ctx_calls  # noqa: E402
from qspec.head_manifest import HEAD_ONNX  # noqa: E402
from qspec.heads import modules  # noqa: E402
from qspec.heads.eagle import eagle_specializations  # noqa: E402
from qspec.heads.medusa import medusa_specializations  # noqa: E402
from qspec.heads.package import compile_head  # noqa: E402
from qspec.specializations import make_config  # noqa: E402
from tests.test_heads_modules import randomize, tiny_target  # noqa: E402

ort = pytest.importorskip("onnxruntime")
FAKE_COMPILER = Path(__file__).parent / "fake_qaic" / "qaic-compile"
CTX = 32


def write_target_tables(folder: Path, target) -> Path:
    """A stand-in target graph holding only the target's tables, named and laid out as the exporter writes
    them (an untied LM head input-major, [hidden, vocab])."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    embed = target.get_input_embeddings().weight.detach().numpy()
    tensors = [numpy_helper.from_array(embed, "model.embed_tokens.weight")]
    lm = target.get_output_embeddings().weight
    if lm.data_ptr() != target.get_input_embeddings().weight.data_ptr():
        tensors.append(numpy_helper.from_array(lm.detach().numpy().T.copy(), "lm_head.weight"))
    node = helper.make_node("Gather", ["model.embed_tokens.weight", "ids"], ["out"])
    graph = helper.make_graph(
        [node],
        "tables",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, embed.shape[1]])],
        initializer=tensors,
    )
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    return folder


def as_stored(head: nn.Module) -> nn.Module:
    """The head with its weights rounded through float16 where the graph stores them so (large ones)."""
    from qspec.heads.export import FP16_MIN_ELEMENTS

    with torch.no_grad():
        for tensor in head.parameters():
            if tensor.numel() >= FP16_MIN_ELEMENTS:
                tensor.copy_(tensor.half().float())
    return head


def session(package: Path, manifest) -> ort.InferenceSession:
    return ort.InferenceSession(str(manifest.path(package, manifest.runtime_graph)), providers=["CPUExecutionProvider"])


def compile_into(tmp_path: Path, head_dir: Path, target, **overrides):
    package = write_target_tables(tmp_path / "package", target)
    config = make_config(num_speculative_tokens="0,1,4", prefill_seq_len=8, ctx_len=CTX, **overrides.pop("spec", {}))
    manifest = compile_head(head_dir, package, config=config, target_fingerprint="target-key", **overrides)
    return package, manifest


# EAGLE -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eagle_package(tmp_path_factory):
    """An EAGLE-1 head with a reduced vocabulary (d2t), compiled for K = 0, 1, 4 without continuous batching."""
    tmp = tmp_path_factory.mktemp("eagle")
    target = tiny_target()
    head = randomize(modules.eagle_from_target(target, draft_ids=torch.tensor([4, 9, 2, 130, 77, 300, 31])))
    modules.save_eagle(head, tmp / "head")
    package, manifest = compile_into(tmp, tmp / "head", target)
    return package, manifest, as_stored(modules.load_eagle(tmp / "head", target))


def features(batch: int, steps: int, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 320, (batch, steps), generator=generator)
    return ids, torch.randn(batch, steps, 64, generator=generator)


def run_eagle(sess, ids, positions, hidden, kv, batch_index=None):
    """One call with the KV arrays ``kv`` bound in place as the runtime binds them (the fused graph's
    GroupQueryAttention writes the call's slots into the shared buffer and leaves the rest)."""
    feeds = {
        contract.INPUT_IDS: ids.numpy(),
        contract.POSITION_IDS: positions.numpy(),
        contract.HIDDEN_STATES: hidden.numpy(),
    }
    if batch_index is not None:
        feeds[contract.BATCH_INDEX] = batch_index
    feeds |= ort_plan.feeds(feeds[contract.POSITION_IDS], 1, {i.name for i in sess.get_inputs()})
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name, array in zip(contract.kv_names(1), kv):
        buffer = ort.OrtValue.ortvalue_from_numpy(array)  # a view of the numpy array
        binding.bind_ortvalue_input(name, buffer)
        binding.bind_ortvalue_output(contract.retained(name), buffer)
    binding.bind_output(contract.LOGITS)
    binding.bind_output(contract.HIDDEN_STATES_OUT)
    sess.run_with_iobinding(binding)
    logits, feature = (value.numpy() for value in binding.get_outputs()[-2:])
    return logits, feature, kv


def test_eagle_manifest_and_files(eagle_package):
    """head.json records the method, layout, sizes and draft ids; the graph has the contract's I/O."""
    package, manifest, _ = eagle_package
    assert head_manifest.check_head(package) == manifest
    assert (manifest.method, manifest.layout, manifest.draft_vocab_size, manifest.vocab_size) == (
        "eagle",
        "eagle",
        7,
        320,
    )
    assert (manifest.num_kv_heads, manifest.head_dim, manifest.ctx_len) == (2, 16, CTX)
    assert manifest.target_fingerprint == "target-key" and manifest.float16_initializers > 0
    ids = head_manifest.read_draft_ids(package, manifest)
    assert ids.tolist() == [4, 9, 2, 130, 77, 300, 31]
    sess = session(package, manifest)
    # the runtime graph: the contract's inputs, then the host's call plan (a one-slot head's)
    assert [i.name for i in sess.get_inputs() if i.name not in ort_plan.NAMES] == manifest.input_names
    assert ort_plan.plan_names({i.name for i in sess.get_inputs()}) == [
        ort_plan.SEQLENS_K,
        ort_plan.QUERY_SEQLENS,
        ort_plan.TOTAL_SEQUENCE_LENGTH,
        ort_plan.KEPT_SLOTS,
    ]
    vendor = ort.InferenceSession(str(manifest.path(package, HEAD_ONNX)), providers=["CPUExecutionProvider"])
    assert [i.name for i in vendor.get_inputs()] == manifest.input_names
    assert [o.name for o in sess.get_outputs()] == manifest.output_names
    shapes = {v.name: v.shape for v in [*sess.get_inputs(), *sess.get_outputs()]}
    assert shapes[contract.HIDDEN_STATES] == ["batch_size", "seq_len", 64]
    # the runtime graph returns each row's last kept rows: one chained, K when a parallel head drafts in one call
    assert shapes[contract.LOGITS] == ["batch_size", "kept_rows", 7]
    assert shapes[contract.HIDDEN_STATES_OUT] == ["batch_size", "kept_rows", 64]
    assert shapes[contract.past_key(0)] == ["batch_size", 2, "ctx_len", 16]
    assert ctx_calls(manifest.path(package, manifest.graph)) == {"CtxScatter": 2, "CtxGather": 4}  # QEfficient's KV ops


def test_the_embedding_is_gathered_in_float16(eagle_package):
    """Both head graphs gather the target's embedding rows from its float16 table and cast the rows: no
    Cast of the whole table, which ONNX Runtime would fold into a float32 copy in every session."""
    import onnx
    from onnx import TensorProto

    package, manifest, _ = eagle_package
    for graph_file in (manifest.runtime_graph, HEAD_ONNX):
        graph = onnx.load(str(manifest.path(package, graph_file)), load_external_data=False).graph
        [embed] = [i for i in graph.initializer if i.name.endswith("embed_tokens.weight.fp16")]
        assert (embed.data_type, list(embed.dims)) == (TensorProto.FLOAT16, [320, 64])
        readers = [n for n in graph.node if embed.name in n.input]
        assert [n.op_type for n in readers] == ["Gather"], graph_file
        casts = [n for n in graph.node if n.op_type == "Cast" and n.input[0] == readers[0].output[0]]
        assert len(casts) == 1 and casts[0].attribute[0].i == TensorProto.FLOAT


def test_eagle_specializations_sorted_and_flat(eagle_package):
    """Prefill, then seq_len 1 and K + 1 per K, ascending; the file is flat and string-valued."""
    package, manifest, _ = eagle_package
    assert [s.seq_len for s in manifest.specializations] == [8, 1, 2, 5]
    wire = json.loads((package / "head" / "specializations.json").read_text())["specializations"]
    assert wire[0] == {"batch_size": "1", "seq_len": "8", "ctx_len": str(CTX)}
    assert all(isinstance(v, str) for entry in wire for v in entry.values())


def test_eagle_prefill_then_chain_equals_teacher_forced(eagle_package):
    """A prefill call then 1-token calls (KV at positions) give the teacher-forced features and logits."""
    package, manifest, head = eagle_package
    sess = session(package, manifest)
    ids, hidden = features(1, 6)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        want = head(ids, hidden, positions)  # [1, 6, 64]
        want_logits = head.logits(want)
    kv = [np.zeros((1, *manifest.kv_shape), np.float32) for _ in range(2)]
    logits, feature, kv = run_eagle(sess, ids[:, :3], positions[:, :3], hidden[:, :3], kv)
    np.testing.assert_allclose(feature[:, 0], want[:, 2].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[:, 0], want_logits[:, 2].numpy(), rtol=1e-4, atol=1e-4)
    for t in range(3, 6):
        logits, feature, kv = run_eagle(sess, ids[:, t : t + 1], positions[:, t : t + 1], hidden[:, t : t + 1], kv)
        np.testing.assert_allclose(feature[:, 0], want[:, t].numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(logits[:, 0], want_logits[:, t].numpy(), rtol=1e-4, atol=1e-4)


def test_eagle_padding_and_rewrite(eagle_package):
    """A right-padded row returns its last real token; a stale draft's slot is overwritten by the next call."""
    package, manifest, head = eagle_package
    sess = session(package, manifest)
    ids, hidden = features(2, 5, seed=9)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]])
    with torch.no_grad():
        want = head(ids, hidden, torch.arange(5).repeat(2, 1))
    kv = [np.zeros((2, *manifest.kv_shape), np.float32) for _ in range(2)]
    _, feature, kv = run_eagle(sess, ids, positions, hidden, kv)
    np.testing.assert_allclose(feature[:, 0], torch.stack([want[0, 4], want[1, 2]]).numpy(), rtol=1e-4, atol=1e-4)
    # Row 1 continues at position 3 with other tokens than a rejected draft would have had: same as teacher forcing.
    ids2, hidden2 = features(2, 1, seed=11)
    with torch.no_grad():
        ref = head(
            torch.cat([ids[1:, :3], ids2[1:]], 1), torch.cat([hidden[1:, :3], hidden2[1:]], 1), torch.arange(4)[None]
        )
    _, feature, _ = run_eagle(sess, ids2, torch.tensor([[5], [3]]), hidden2, kv)
    np.testing.assert_allclose(feature[1, 0], ref[0, 3].numpy(), rtol=1e-4, atol=1e-4)


def test_eagle_continuous_batching(tmp_path):
    """With full_batch_size the head's KV has FBS rows and batch_index picks each call's slot."""
    target = tiny_target()
    head = randomize(modules.eagle_from_target(target))
    modules.save_eagle(head, tmp_path / "head")
    package, manifest = compile_into(tmp_path, tmp_path / "head", target, spec={"full_batch_size": 3})
    assert manifest.continuous_batching and contract.BATCH_INDEX in manifest.input_names
    assert [(s.batch_size, s.seq_len, s.full_batch_size) for s in manifest.specializations] == [
        (1, 8, 3),
        (3, 1, 3),
        (3, 2, 3),
        (3, 5, 3),
    ]
    head = as_stored(modules.load_eagle(tmp_path / "head", target))
    sess = session(package, manifest)
    ids, hidden = features(1, 4)
    with torch.no_grad():
        want = head(ids, hidden, torch.arange(4)[None])
    kv = [np.zeros((3, *manifest.kv_shape), np.float32) for _ in range(2)]
    _, feature, kv = run_eagle(sess, ids[:, :3], torch.arange(3)[None], hidden[:, :3], kv, np.array([[2]]))
    assert not kv[0][:2].any() and kv[0][2].any()  # only slot 2 was written
    assert ctx_calls(manifest.path(package, manifest.graph)) == {"CtxScatterCB": 2, "CtxGatherCB": 4}
    _, feature, _ = run_eagle(sess, ids[:, 3:], torch.tensor([[3]]), hidden[:, 3:], kv, np.array([[2]]))
    np.testing.assert_allclose(feature[:, 0], want[:, 3].numpy(), rtol=1e-4, atol=1e-4)


def test_eagle_pytorch_bin_full_vocab_int4(tmp_path):
    """pytorch_model.bin without d2t (full vocabulary), int4: MatMulNBits in head.ort.onnx, logits near torch."""
    target = tiny_target(tie=False)
    head = randomize(modules.eagle_from_target(target, fc_bias=True))
    torch.save({k: v for k, v in head.state_dict().items() if k not in modules.TABLES}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(head.config.to_json_string())
    os.makedirs(tmp_path / "head")
    for name in ("pytorch_model.bin", "config.json"):
        shutil.move(tmp_path / name, tmp_path / "head" / name)
    package, manifest = compile_into(tmp_path, tmp_path / "head", target, weight_format="int4")
    assert manifest.draft_ids_file is None and manifest.draft_vocab_size == 320
    assert manifest.runtime_graph == head_manifest.HEAD_ORT_ONNX
    assert manifest.quantized_matmuls == 7  # fc, packed q/k/v, o, gate, up, down, LM head
    sess = session(package, manifest)
    ids, hidden = features(1, 4)
    with torch.no_grad():
        want = as_stored(modules.load_eagle(tmp_path / "head", target)).logits(head(ids, hidden, torch.arange(4)[None]))
    kv = [np.zeros((1, *manifest.kv_shape), np.float32) for _ in range(2)]
    logits, _, _ = run_eagle(sess, ids, torch.arange(4)[None], hidden, kv)
    assert np.corrcoef(logits[0, 0], want[0, 3].numpy())[0, 1] > 0.95  # random 4-bit weights: near, not equal


# Medusa and turbo ------------------------------------------------------------------------------------


def test_medusa_fasterdecoding_layout(tmp_path):
    """FasterDecoding's medusa_lm_head.safetensors: ONNX logits [batch, heads, vocab] equal the torch heads."""
    from safetensors.torch import save_file

    from tests.test_heads_modules import _FasterDecodingMedusa

    target = tiny_target()
    reference = as_stored(randomize(_FasterDecodingMedusa(64, 320, num_heads=3, num_layers=2)).eval())
    (tmp_path / "head").mkdir()
    save_file(
        {k: v.clone() for k, v in reference.medusa_head.state_dict().items()},
        str(tmp_path / "head" / "medusa_lm_head.safetensors"),
    )
    (tmp_path / "head" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    package, manifest = compile_into(tmp_path, tmp_path / "head", target, spec={"full_batch_size": 4})
    assert (manifest.method, manifest.layout, manifest.num_heads, manifest.num_layers) == ("medusa", "medusa", 3, 2)
    assert [s.batch_size for s in manifest.specializations] == [1, 4]
    wire = json.loads((package / "head" / "specializations.json").read_text())["specializations"]
    assert wire == [{"batch_size": "1"}, {"batch_size": "4"}]  # the graph's only symbol
    hidden = torch.randn(4, 1, 64)
    (logits,) = session(package, manifest).run(None, {contract.HIDDEN_STATES: hidden.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(logits, reference(hidden)[:, 0].numpy(), rtol=1e-4, atol=1e-4)


def test_turbo_layout_uses_the_targets_lm_head(tmp_path):
    """QEfficient turbo projections (shared layers) on the target's LM head, compiled and run."""
    target = tiny_target()
    head = randomize(modules.MedusaHead(64, 2, 3, target.lm_head.weight, shared_layers=True))
    modules.save_turbo(head, tmp_path / "head")
    package, manifest = compile_into(tmp_path, tmp_path / "head", target, spec_format="named")
    assert manifest.layout == "turbo" and manifest.draft_vocab_size == 320 and manifest.num_heads == 2
    wire = json.loads((package / "head" / "specializations.json").read_text())["specializations"]
    assert wire == [{"name": "Batch_1", "symbols": {"batch_size": "1"}}]
    hidden = torch.randn(1, 1, 64)
    (logits,) = session(package, manifest).run(None, {contract.HIDDEN_STATES: hidden.numpy()})
    with torch.no_grad():
        want = as_stored(modules.load_turbo(tmp_path / "head", target))(hidden)[:, 0]
    np.testing.assert_allclose(logits, want.numpy(), rtol=1e-4, atol=1e-4)


# Vendor files ----------------------------------------------------------------------------------------


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path: Path) -> str:
    """The stand-in qaic-compile first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    target = bin_dir / "qaic-compile"
    shutil.copy(FAKE_COMPILER, target)
    target.chmod(target.stat().st_mode | stat.S_IXUSR)
    monkeypatch.delenv("QAIC_COMPILE", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]))
    return str(target)


def test_qaic_head_program(tmp_path, fake_compiler):
    """backend qaic: the head gets its own custom IO (KV + features), named specializations and a QPC."""
    target = tiny_target()
    modules.save_eagle(randomize(modules.eagle_from_target(target)), tmp_path / "head")
    package, manifest = compile_into(tmp_path, tmp_path / "head", target, backend="qaic", spec_format="named")
    folder = package / "head"
    custom_io = (folder / "custom_io.yaml").read_text()
    for name in ("past_key.0", "past_value.0_RetainedState", "hidden_states", "hidden_states_out"):
        assert f"IOName: {name}\n" in custom_io
    assert manifest.qaic is not None and manifest.qaic.ran
    assert (folder / "qpc" / "programqpc.bin").is_file() and (folder / "compile_qaic.sh").is_file()
    names = [e["name"] for e in json.loads((folder / "specializations.json").read_text())["specializations"]]
    assert names == ["Prefill", "Decode_0", "Decode_1", "Decode_2"]  # QEfficient's names


def test_specializations_of_each_method():
    """EAGLE: prefill + seq_len 1 and K + 1 (de-duplicated), a parallel head's K + min(depth, K) too; Medusa: one per
    row count."""
    config = make_config(num_speculative_tokens="4,0", prefill_seq_len=1, ctx_len=CTX)
    assert [s.seq_len for s in eagle_specializations(config)] == [1, 5]
    assert [s.seq_len for s in eagle_specializations(config, 3)] == [1, 5, 7]  # a parallel head's mask pairs too
    assert [s.batch_size for s in medusa_specializations(config)] == [1]


def test_package_without_head_says_how(tmp_path):
    """Reading the head of a package without one names the compile option."""
    with pytest.raises(PackageError, match="--draft-head"):
        head_manifest.read_head_manifest(tmp_path)


def test_compile_package_with_draft_head(tiny_model, tmp_path):
    """compile_package(draft_head=...) puts the head beside a real export, reading the target's untied LM head."""
    from transformers import AutoModelForCausalLM

    from qspec.compile import CompileOptions, compile_package

    model_dir = tiny_model("llama", tie=False)
    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    head = randomize(modules.eagle_from_target(target, draft_ids=torch.tensor([7, 3, 250])))
    modules.save_eagle(head, tmp_path / "head")
    options = CompileOptions(
        specialization=make_config(num_speculative_tokens="0,2", prefill_seq_len=8, ctx_len=64),
        draft_head=str(tmp_path / "head"),
        draft_head_weight_format="fp32",  # the torch head's numbers, not a quantized copy's
    )
    package, manifest, _ = compile_package(model_dir, options, output=tmp_path / "pkg")
    head_info = head_manifest.read_head_manifest(package)
    assert head_info.target_fingerprint == manifest.model.export_key
    assert [s.seq_len for s in head_info.specializations] == [8, 1, 3]
    reference = as_stored(modules.load_eagle(tmp_path / "head", target))
    ids, hidden = features(1, 3)
    with torch.no_grad():
        want = reference.logits(reference(ids, hidden, torch.arange(3)[None]))
    kv = [np.zeros((1, *head_info.kv_shape), np.float32) for _ in range(2)]
    logits, _, _ = run_eagle(session(package, head_info), ids, torch.arange(3)[None], hidden, kv)
    np.testing.assert_allclose(logits[:, 0], want[:, 2].numpy(), rtol=1e-4, atol=1e-4)
    again = CompileOptions(specialization=options.specialization)
    assert compile_package(model_dir, again, output=tmp_path / "pkg")[2] is False  # the head is part of the key


def test_the_head_beside_an_fp32_target_is_int8_unless_asked(tiny_model, tmp_path):
    """By default an fp32 package's head runs int8 MatMuls (its weights are read from memory after every target
    call); an int4 package's head is int4; ``draft_head_weight_format`` overrides, and is part of the package's key."""
    from transformers import AutoModelForCausalLM

    from qspec.compile import CompileOptions, compile_package

    model_dir = tiny_model("llama")
    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    modules.save_eagle(randomize(modules.eagle_from_target(target)), tmp_path / "head")
    spec = make_config(num_speculative_tokens="0,2", prefill_seq_len=8, ctx_len=64)
    head = str(tmp_path / "head")
    default = CompileOptions(specialization=spec, draft_head=head)
    assert default.head_weight_format == "int8"
    assert CompileOptions(specialization=spec, draft_head=head, weight_format="int4").head_weight_format == "int4"
    package, _, _ = compile_package(model_dir, default, output=tmp_path / "pkg")
    info = head_manifest.read_head_manifest(package)
    assert info.weight_format == "int8" and info.quantized_matmuls > 0
    asked = CompileOptions(specialization=spec, draft_head=head, draft_head_weight_format="fp32")
    package, _, reused = compile_package(model_dir, asked, output=tmp_path / "pkg")
    assert not reused and head_manifest.read_head_manifest(package).weight_format == "fp32"
    with pytest.raises(ValueError, match="give --draft-head too"):
        CompileOptions(specialization=spec, draft_head_weight_format="int4")
    with pytest.raises(ValueError, match="for the ort backend"):
        CompileOptions(specialization=spec, draft_head=head, draft_head_weight_format="int4", backend="qaic")


def test_symbolic_dims_are_the_specialization_keys(eagle_package, tmp_path):
    """Every symbolic dimension of a head graph is a key of its specializations file, and every key a dimension."""
    from qspec.export.graph import graph_dims

    def check(package, manifest):
        dims = graph_dims(manifest.path(package, manifest.graph))
        symbols = {d for shape in dims.values() for d in shape if isinstance(d, str)}
        wire = json.loads(manifest.path(package, manifest.specializations_file).read_text())["specializations"]
        assert symbols == {key for entry in wire for key in entry}

    check(*eagle_package[:2])
    target = tiny_target()
    modules.save_medusa(randomize(modules.medusa_from_target(target, 2)), tmp_path / "head")
    check(*compile_into(tmp_path, tmp_path / "head", target, spec={"full_batch_size": 2}))


def test_cli_compile_with_draft_head(tiny_model, tmp_path):
    """`qspec compile --draft-head` writes the head and names it; a folder without a head is a one-line error."""
    from tests.test_cli import assert_one_line_error, qspec

    model_dir = tiny_model("llama")
    modules.save_medusa(randomize(modules.medusa_from_target(tiny_target(), 2)), tmp_path / "head")
    args = ("compile", str(model_dir), "-k", "0,2", "--ctx-len", "64", "--prefill-seq-len", "8")
    result = qspec(*args, "--draft-head", str(tmp_path / "head"), "-o", str(tmp_path / "pkg"))
    assert result.returncode == 0, result.stderr
    assert "draft head: medusa (medusa), 1 specializations" in result.stdout
    assert head_manifest.check_head(tmp_path / "pkg").num_heads == 2
    (tmp_path / "empty").mkdir()
    bad = qspec(*args, "--draft-head", str(tmp_path / "empty"), "-o", str(tmp_path / "pkg2"))
    assert_one_line_error(bad, "holds no draft head")
    assert not (tmp_path / "pkg2").exists()
