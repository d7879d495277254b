"""The embedded backend's own graph: fused, optionally weight-quantized, optimized by ONNX Runtime.

The vendor graph ``model.onnx`` is the contract and stays as exported (the ``qaic`` backend compiles
it). For ONNX Runtime the ``ort`` backend writes ``model.ort.onnx`` beside it, made by kept tools
only, in this order:

1. **fuse** (``onnxscript.rewriter.ort_fusions``): RMSNorm -> ``SimplifiedLayerNormalization`` and
   residual Add + RMSNorm -> ``SkipSimplifiedLayerNormalization``. ONNX Runtime's own RMSNorm
   fusion expects ``Sqrt -> Div`` and never matches the dynamo exporter's ``Reciprocal(Sqrt)``.
   With the export's :class:`AttentionInfo`, each layer's attention becomes one
   ``GroupQueryAttention`` node (:mod:`qspec.backends.ort_attention`, which maps the contract's
   position-driven KV write and padding onto it; q, k and v packed into one MatMul).
   With the export's :class:`MoEInfo`, each mixture-of-experts block (Mixtral, Qwen3-MoE, DeepSeek-V3's routed
   experts) becomes one ``com.microsoft.MoE`` node running each token's top-k experts only, or ``QMoE`` in
   int8/int4 (:mod:`qspec.backends.ort_moe`); DeepSeek-V3's group-limited routing stays in the graph and feeds it.

``fp32`` stops here: the fused graph keeps its own weights, the packed q/k/v and the RoPE tables, in
``model.ort.onnx.data``, page-aligned, and reads every other weight from the vendor graph's
``model.onnx.data`` (same names, same offsets), so a package holds those once (kept inline in the
``.onnx`` file instead, the same graph's calls were slower). The session-level optimizations
(constant folding, SiLU, MatMul + scale, ...) are ONNX Runtime's own at load time (``ORT_ENABLE_ALL``,
the default).

2. **materialize the tied LM head** (int8/int4 only; onnxscript's constant folder): a tied head is
   ``MatMul(x, Transpose(embedding))``, which no weight quantizer picks up; folding the Transpose
   gives the head its own ``[hidden, vocab]`` initializer. The embedding ``Gather`` keeps the fp32
   table: it reads a few rows per call, so it costs memory, not bandwidth.
3. **quantize** (int8/int4; ``onnxruntime.quantization.matmul_nbits_quantizer``): every MatMul
   with a constant 2-D weight becomes ``MatMulNBits`` (block-wise, symmetric: no zero points, blocks
   along K), one weight at a time, into the graph's own ``model.ort.onnx.data``. The weights it keeps
   (the embedding, the norms) stay in the vendor graph's ``model.onnx.data``, as in fp32, and ONNX
   Runtime's session-level fusions run at load time, as in fp32 (docs/scale.md).

``cached_runtime_graph`` keeps the result in the export cache, keyed by the export and the format.
The result keeps the contract's inputs, outputs and symbolic dimensions; the parity tests run on it.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from qspec import contract
from qspec.backends.ort_gguf import GGUFBlocks
from qspec.backends.ort_quantize import (
    ACCURACY_LEVEL,
    BITS,
    BLOCK_SIZE,
    SYMMETRIC,
    WIDENED_MATMULS,
    external_data_files,
    quantize_streamed,
    tied_tables,
    widen_one_row_matmuls,
)
from qspec.backends.ort_weights import externalize_own_weights, own_source_weights
from qspec.common import build_directory
from qspec.onnx_files import load_model, save_model
from qspec.package import (
    LONE_QUERY,
    ORT_ONNX_FILE,
    PACKED_TOKENS,
    TREE_ATTENTION,
    TRIMMED_ROWS,
    AttentionInfo,
    MoEInfo,
    RuntimeGraph,
    WeightFormat,
)

Progress = Callable[[str], None]

# Bump when the recipe below changes: cached runtime graphs are keyed by it (and packages, whose draft
# head graph is built with it: 28, the head's call plan; 31, the MoE operator; 32, tree attention; 33, a
# one-token call of a graph with its attention as exported runs one padding token more; weight_bytes counts the
# routed experts a token reads; an fp32 graph with the MoE operator holds all its weights in its own data file;
# 34, DeepSeek-V3's routed experts as the MoE operator fed the graph's routing table; 35, a graph with the
# host's plan widens a 4-bit product only when it has one row in the call).
RECIPE_VERSION = 35
ONE_MORE_TOKEN = "one_more_token"  # RuntimeGraph.fusions key: ort_tokens.pad_one_more_token
OWN_WEIGHTS = "own_weights"  # RuntimeGraph.fusions key: own_source_weights (fp32 with the MoE operator)
GRAPH_META = "graph.json"


def fuse(model) -> dict[str, int]:
    """RMSNorm and skip-RMSNorm fusions on an ``onnx_ir`` model, its inputs' and outputs' shapes kept;
    returns the count of each.

    No constant folding first: the rules match the exported graph as it is, and folding (slow: mostly
    weight transposes) is what ONNX Runtime does anyway when it loads the graph.
    """
    import onnx_ir.passes.common as common_passes
    from onnxscript import optimizer
    from onnxscript.rewriter.ort_fusions import rms_normalization, skip_normalization

    contract_shapes = {value.name: value.shape for value in (*model.graph.inputs, *model.graph.outputs)}
    _output_taps_through_identity(model)
    common_passes.ShapeInferencePass()(model)  # the fusion rules check ranks and shapes
    counts = {
        "rms_normalization": rms_normalization.fuse_rms_normalization(model),
        "skip_rms_normalization": skip_normalization.fuse_skip_rms_normalization(model),
    }
    optimizer.remove_unused_nodes(model)
    for value in (*model.graph.inputs, *model.graph.outputs):  # shape inference may rename symbolic dims
        value.shape = contract_shapes[value.name]
    return counts


def _output_taps_through_identity(model) -> int:
    """Each ``tap.{i}`` output (:mod:`qspec.export.taps`) through an ``Identity`` of the residual it taps, and the
    residual's shape left to inference: the skip-norm rule binds its inputs' dims, and a residual carrying the
    contract's dim names would stay unfused and round differently from the package without taps (whose logits
    must stay bitwise the same). Returns how many."""
    import onnx_ir as ir

    from qspec.export.graph import TAP_PREFIX

    graph = model.graph
    count = 0
    for index, value in enumerate(list(graph.outputs)):
        if not (value.name or "").startswith(TAP_PREFIX):
            continue
        node = ir.node("Identity", [value], name=f"{value.name}.identity")
        graph.append(node)
        out = node.outputs[0]
        out.shape, out.type = value.shape, value.type
        name, value.name = value.name, f"{value.name}.residual"
        value.shape = None  # inferred as in the graph without taps (the rules bind the dims of Add's inputs)
        out.name = name
        graph.outputs[index] = out
        count += 1
    return count


NORMALIZATIONS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def omit_unused_statistics(model) -> int:
    """Leave out the normalization nodes' optional outputs no node reads (mean, inverse std): named, ONNX
    Runtime allocates and writes them on every call (``docs/perf.md``). Returns how many were left out. Call
    it just before the model is written: a later pass may name them again."""
    outputs = set(model.graph.outputs)
    omitted = 0
    for node in model.graph.all_nodes():
        if node.op_type not in NORMALIZATIONS:
            continue
        for value in node.outputs[1:]:
            if value.name != "" and not value.uses() and value not in outputs:
                value.name = ""  # an omitted optional output
                omitted += 1
    return omitted


def drop_unused_functions(model) -> None:
    """Remove the functions no node calls, and their domains' opset imports."""
    import onnx_ir.passes.common as common_passes

    common_passes.RemoveUnusedFunctionsPass()(model)
    common_passes.RemoveUnusedOpsetsPass()(model)


def materialize_transposed_weights(model) -> int:
    """Fold ``Transpose(initializer)`` feeding a MatMul into its own initializer; returns how many."""
    from onnxscript import optimizer

    def is_weight_transpose(node) -> bool | None:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return None
        source = node.inputs[0]
        feeds_matmul = any(user.op_type == "MatMul" for user, _ in node.outputs[0].uses())
        return True if source is not None and source.is_initializer() and feeds_matmul else None

    before = _count_ops(model, "Transpose")
    optimizer.fold_constants(
        model, input_size_limit=1 << 40, output_size_limit=1 << 40, should_fold=is_weight_transpose
    )
    optimizer.remove_unused_nodes(model)
    return before - _count_ops(model, "Transpose")


def streamed_weight_bytes(path: Path) -> int:
    """Bytes of the initializers a one-token call reads: all but tables that are only indexed (the embedding's
    ``Gather``, the RoPE tables of ``GroupQueryAttention``: a call reads the rows of its positions), and of the
    experts of a ``MoE`` / ``QMoE`` node only the ``k`` a token is routed to.

    Example: a ``MoE`` node with ``k=2`` over 8 experts whose ``fc1`` and ``fc2`` hold 64 MB together counts
    16 MB (2/8 of them), what one token reads. A call of ``T`` tokens reads up to ``min(8, 2 T)`` experts (a
    K=4 verify, 5 tokens: all 8 if they route apart), so this is the one-token call's floor, the bound's
    numerator; the static form of the experts (two MatMuls over all of them) reads them all and counts whole.
    """
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    lookups = {"Gather", "GatherBlockQuantized", "GroupQueryAttention", "Reshape"}  # Reshape: a table's blocks
    users: dict[str, set[str]] = collections.defaultdict(set)
    routed: dict[str, int] = {}  # expert initializer -> experts a token reads (the MoE node's k)
    for node in proto.graph.node:
        for name in node.input:
            users[name].add(node.op_type)
        if node.domain == "com.microsoft" and node.op_type in ("MoE", "QMoE"):
            k = next((a.i for a in node.attribute if a.name == "k"), 1)
            routed |= {name: k for name in node.input[2:] if name}
    total = 0
    for tensor in proto.graph.initializer:
        if users[tensor.name] and users[tensor.name] <= lookups:
            continue
        size = _tensor_bytes(tensor)
        if tensor.name in routed and users[tensor.name] <= {"MoE", "QMoE"}:
            size = size * routed[tensor.name] // tensor.dims[0]  # [experts, ...]: k of them per token
        total += size
    return total


def optimize_graph(
    source: Path,
    target: Path,
    weight_format: WeightFormat,
    *,
    block_size: int = BLOCK_SIZE,
    accuracy_level: int = ACCURACY_LEVEL,
    symmetric: bool = SYMMETRIC,
    progress: Progress | None = None,
    attention: AttentionInfo | None = None,
    rope_positions: int = 0,
    lone_query: bool = False,
    gguf: Path | None = None,
    moe: MoEInfo | None = None,
) -> RuntimeGraph:
    """Write the embedded backend's graph of ``source`` (the contract graph) to ``target``.

    ``gguf``: the GGUF file the model was exported from: int8/int4 weights it holds in blocks ``MatMulNBits``
    represents exactly are carried over as they are (:mod:`qspec.backends.ort_gguf`).

    ``attention``: the export's :class:`AttentionInfo`; with it, attention becomes ONNX Runtime's
    ``GroupQueryAttention`` (:mod:`qspec.backends.ort_attention`) with a RoPE table of
    ``rope_positions`` rows; without it, attention stays as exported. ``lone_query``: a graph for a package
    without drafts runs a one-token call's attention on its token alone (no exactness pad; not with
    several KV rows, whose calls may carry a prompt chunk beside a decode row).

    ``moe``: the export's :class:`MoEInfo`; with it, its MoE blocks become ONNX Runtime's ``MoE`` (fp32) or
    ``QMoE`` (int8/int4) operator (:mod:`qspec.backends.ort_moe`).
    """
    from qspec.backends.ort_attention import fuse_attention
    from qspec.backends.ort_moe import FUSION as MOE_FUSION
    from qspec.backends.ort_moe import fuse_moe

    say = progress or (lambda message: None)
    begin = time.perf_counter()
    model = load_model(source)  # weights stay in the source's external data until needed
    bits = BITS.get(weight_format)
    say("fusing RMSNorm and skip-RMSNorm (onnxscript)")
    fusions = fuse(model)
    if attention is not None:
        say("fusing attention (GroupQueryAttention)")
        # Every node but attention on live tokens only: with several KV rows the call's live tokens are
        # packed ([1, live, width], scattered to the op's rows and back in every layer); without, each
        # row is cut to the call's most live tokens in a row before the embedding (attention still pads
        # a one-token call, see ort_attention).
        pack = contract.BATCH_INDEX in {value.name for value in model.graph.inputs}
        lone = lone_query and not pack
        # A graph with drafts verifies trees where the op's window (by slot, not position) cannot misplace one.
        tree = not lone and not pack and all(window is None for window in attention.windows)
        fusions["group_query_attention"] = fuse_attention(
            model,
            attention,
            rope_positions,
            pack_qkv=True,
            pack_tokens=pack,
            trim_rows=not pack,
            lone_query=lone,
            tree=tree,
        )
        fusions[PACKED_TOKENS if pack else TRIMMED_ROWS] = 1
        if lone:
            fusions[LONE_QUERY] = 1
        if tree:
            fusions[TREE_ATTENTION] = 1
        drop_unused_functions(model)  # the KV's CtxScatter/CtxGather: attention no longer calls them
    elif not lone_query and not set(contract.TREE_INPUTS) & {value.name for value in model.graph.inputs}:
        # attention as exported (DeepSeek-V3's MLA, Gemma 3): no MatMul on a lone row (a graph with the vendor
        # graph's tree inputs, [batch, seq, ...] each, keeps its one-token calls as they are)
        from qspec.backends.ort_tokens import pad_one_more_token

        pad_one_more_token(model.graph)
        fusions[ONE_MORE_TOKEN] = 1
    if moe is not None:
        say(
            "fusing mixture-of-experts blocks (MoE)"
            if bits is None
            else f"quantizing experts to {weight_format} (QMoE)"
        )
        fusions[MOE_FUSION] = fuse_moe(model, moe, bits=bits, settings=(block_size, accuracy_level, symmetric))
    quantized, carried = 0, {}
    own_data, vendor_data = target.with_name(target.name + ".data"), source.name + ".data"
    if bits is None:
        if fusions.get(MOE_FUSION):  # the source's data holds the stacked experts a MoE node no longer reads
            fusions[OWN_WEIGHTS] = own_source_weights(model)
        externalize_own_weights(model, own_data)  # the packed q/k/v and tables; the rest stays in the source's
    else:
        tied = tied_tables(model)
        fusions["materialized_weights"] = materialize_transposed_weights(model)
        gguf_blocks = None
        if gguf is not None:
            say(f"reading the GGUF blocks of {gguf.name}")
            gguf_blocks = GGUFBlocks.index(gguf)
        say(f"quantizing MatMul weights to {weight_format} (MatMulNBits, block {block_size}), one at a time")
        quantized = quantize_streamed(
            model,
            bits,
            own_data,
            block_size=block_size,
            accuracy_level=accuracy_level,
            symmetric=symmetric,
            tied=tied,
            gguf_blocks=gguf_blocks,
            progress=say,
        )
        fusions["quantized_tables"] = _count_ops(model, "GatherBlockQuantized")
        if not lone_query:
            fusions[WIDENED_MATMULS] = widen_one_row_matmuls(model)
        carried = dict(gguf_blocks.carried) if gguf_blocks is not None else {}
    data_files = external_data_files(model)
    omit_unused_statistics(model)
    save_model(model, target)
    return RuntimeGraph(
        file=target.name,
        weight_format=weight_format,
        fusions=fusions,
        quantized_matmuls=quantized,
        block_size=block_size if bits else None,
        accuracy_level=accuracy_level if bits else None,
        symmetric=symmetric if bits else None,
        gguf_blocks=carried,
        data_file=own_data.name if own_data.name in data_files else vendor_data,
        vendor_data_file=vendor_data if {own_data.name, vendor_data} <= data_files else None,
        weight_bytes=streamed_weight_bytes(target),
        rope_positions=rope_positions if fusions.get("group_query_attention", 0) else None,
        seconds=round(time.perf_counter() - begin, 2),
    )


def cached_runtime_graph(
    export_dir: Path,
    export_key: str,
    weight_format: WeightFormat,
    *,
    progress: Progress | None = None,
    attention: AttentionInfo | None = None,
    positions: int = 0,
    lone_query: bool = False,
    gguf: Path | None = None,
    moe: MoEInfo | None = None,
) -> tuple[Path, RuntimeGraph]:
    """The runtime graph of an export (folder holding ``model.ort.onnx`` and its ``.data``), built once.

    An fp32 graph also reads the export's ``model.onnx.data``: it is valid beside it, as in a package.
    ``positions``: the most positions a call may rotate (``ctx_len`` + the longest ``seq_len``); the RoPE
    table of a GroupQueryAttention graph gets the next power of two, so a few graphs serve every ``ctx_len``.
    """
    rope_positions = 1 << max(positions - 1, 0).bit_length() if attention is not None else 0
    gguf = gguf if weight_format in BITS else None  # an fp32 graph keeps the export's weights
    from qspec.export.exporter import ONNX_FILE, cache_root

    settings = (
        f"{export_key}|{weight_format}|{BLOCK_SIZE}|{ACCURACY_LEVEL}|{SYMMETRIC}|{rope_positions}|{RECIPE_VERSION}|"
        f"{_versions()}|{'lone' if lone_query else 'padded'}|{'gguf' if gguf is not None else ''}|"
        f"{moe.model_dump_json() if moe is not None else ''}"
    )
    key = hashlib.sha256(settings.encode()).hexdigest()[:24]
    final = cache_root() / "ort-graphs" / key
    if (final / GRAPH_META).is_file():
        return final, RuntimeGraph.model_validate_json((final / GRAPH_META).read_text())

    def build(folder: Path) -> RuntimeGraph:
        graph = optimize_graph(
            export_dir / ONNX_FILE,
            folder / ORT_ONNX_FILE,
            weight_format,
            progress=progress,
            attention=attention,
            rope_positions=rope_positions,
            lone_query=lone_query,
            gguf=gguf,
            moe=moe,
        )
        (folder / GRAPH_META).write_text(graph.model_dump_json(indent=2) + "\n")
        return graph

    return final, build_directory(final, build)


def _versions() -> str:
    import onnxruntime
    import onnxscript

    return f"onnxruntime={onnxruntime.__version__};onnxscript={onnxscript.__version__}"


def _count_ops(model, op_type: str) -> int:
    return sum(1 for node in model.graph.all_nodes() if node.op_type == op_type)


def _tensor_bytes(tensor) -> int:
    import onnx

    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.raw_data:
        return len(tensor.raw_data)
    return onnx.numpy_helper.to_array(tensor).nbytes
