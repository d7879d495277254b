"""The exported graph's contract as the exporter checks it: the opset, the options that shape the graph,
and the names and dimensions of every input and output.

The exporter (:mod:`qspec.export.exporter`) and the piece tracer (:mod:`qspec.export.trace`) both import
this module; it imports neither, and no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qspec import contract
from qspec.errors import ConfigError

OPSET = 18
TAP_PREFIX = "tap."  # graph output `tap.{i}`: the residual stream entering decoder layer i
VLLM_TAPS = "vllm"  # vLLM's EAGLE-3 default taps: (2, L // 2, L - 3)


class ExportOptions(BaseModel):
    """What changes the graph: the variant of the contract and an optional layer cut (draft models)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    continuous_batching: bool = False  # `batch_index` input, KV buffers of `full_batch_size` rows
    speculative: bool = True  # `num_logits_to_keep` input: logits of the last K + 1 positions
    comp_ctx_lengths: bool = False  # `comp_ctx_lengths` input: its length bounds the KV slots attention reads
    tree_inputs: bool = False  # `write_slots`, `tree_mask`, `kv_moves` inputs: verify rows may be trees
    num_layers: int | None = Field(default=None, ge=1)  # keep only the first N decoder layers
    hidden_states: bool = False  # `hidden_states` output: the final-norm state of every position (draft heads)
    # `tap.{i}` outputs [batch, seq, hidden]: the residual stream entering layer i (Hugging Face's
    # output_hidden_states[i], 0 the embeddings), as vLLM's llama.py collects EAGLE-3's aux hidden states
    taps: tuple[int, ...] | Literal["vllm"] = ()
    # DeepSeek-V3's multi-head latent attention: cache the normed latent and the rotated shared key
    # (compressed_kv.{i}, k_pe.{i}; QEfficient's cache_compressed) with kv_b_proj absorbed; False: every head's
    # expanded key and value (past_key.{i}, past_value.{i}; QEfficient's default). Other families: no effect.
    latent_cache: bool = True


def tap_name(layer: int) -> str:
    return f"{TAP_PREFIX}{layer}"


def tap_layers(taps: tuple[int, ...] | str, num_layers: int) -> tuple[int, ...]:
    """The layer ids ``taps`` names, ascending and distinct (the order vLLM collects them in).

    Example: ``tap_layers("vllm", 30) == (2, 15, 27)``; ``tap_layers((5, 2), 30) == (2, 5)``.
    """
    ids = (2, num_layers // 2, num_layers - 3) if taps == VLLM_TAPS else tuple(taps)
    ids = tuple(sorted(set(ids)))
    if ids and (ids[0] < 0 or ids[-1] >= num_layers):
        raise ConfigError(f"taps {list(ids)} name layers outside 0..{num_layers - 1}; give ids of the target's layers")
    return ids


def expected_dims(num_layers: int, options: ExportOptions, vocab_size: int, *, latent: bool = False) -> dict[str, list]:
    """Dimension names (or sizes) of every graph input and output, per the contract (``latent``: DeepSeek's
    compressed cache names, :func:`qspec.contract.kv_names`)."""
    rows = contract.FULL_BATCH_SIZE if options.continuous_batching else contract.BATCH_SIZE
    tokens = [contract.BATCH_SIZE, contract.SEQ_LEN]
    dims = {contract.INPUT_IDS: tokens, contract.POSITION_IDS: tokens}
    if options.continuous_batching:
        dims[contract.BATCH_INDEX] = [contract.BATCH_SIZE, 1]
    if options.speculative:
        dims[contract.NUM_LOGITS_TO_KEEP] = [contract.NUM_LOGITS_TO_KEEP, 1]
    if options.comp_ctx_lengths:
        dims[contract.COMP_CTX_LENGTHS] = [contract.COMP_CTX_LENGTHS]
    if options.tree_inputs:
        dims[contract.WRITE_SLOTS] = tokens
        dims[contract.TREE_MASK] = [*tokens, contract.SEQ_LEN]
        dims[contract.KV_MOVES] = [*tokens, 2]
    kv = [rows, None, contract.CTX_LEN, None]  # None: a fixed size the contract does not name
    kv_names = contract.kv_names(num_layers, latent=latent)
    dims |= {name: kv for name in kv_names}
    keep = contract.NUM_LOGITS_TO_KEEP if options.speculative else 1
    dims[contract.LOGITS] = [contract.BATCH_SIZE, keep, vocab_size]
    if options.hidden_states:
        dims[contract.HIDDEN_STATES] = [contract.BATCH_SIZE, contract.SEQ_LEN, None]
    dims |= {tap_name(i): [contract.BATCH_SIZE, contract.SEQ_LEN, None] for i in tap_layers(options.taps, num_layers)}
    return dims | {contract.retained(name): kv for name in kv_names}


def graph_dims(path: Path) -> dict[str, list]:
    """``{io name: [dim_param or dim_value, ...]}`` of a saved graph, without loading its weights."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {
        value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        for value in list(proto.graph.input) + list(proto.graph.output)
    }


# QEfficient's KV write and read functions (see qspec.export.ctx_functions), by variant.
CTX_DOMAIN = "com.qualcomm.cloud"
CTX_SCATTER = {False: "CtxScatter", True: "CtxScatterCB"}  # key: continuous batching
CTX_GATHER = {False: "CtxGather", True: "CtxGatherCB"}


def ctx_calls(path: Path) -> dict[str, int]:
    """``{function name: calls}`` of the ``com.qualcomm.cloud`` functions a saved graph calls."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    calls: dict[str, int] = {}
    for node in proto.graph.node:
        if node.domain == CTX_DOMAIN:
            calls[node.op_type] = calls.get(node.op_type, 0) + 1
    return calls


def check_ctx_functions(path: Path, num_layers: int, options: ExportOptions) -> None:
    """Every layer writes its key and value with QEfficient's scatter of the graph's variant, reads them with
    its gather, and the graph defines each function it calls (with a body) in the function's domain."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    calls = ctx_calls(path)
    cb = options.continuous_batching
    # With tree inputs a layer also copies moved KV slots (one more scatter per K and V) and places the ancestor
    # mask at the call's slots (one CtxScatter over the queries: not a KV write, never the CB variant).
    writes = 4 if options.tree_inputs else 2
    mask = {CTX_SCATTER[False]: num_layers} if options.tree_inputs else {}
    kv_writes = calls.get(CTX_SCATTER[cb], 0) - mask.get(CTX_SCATTER[cb], 0)
    assert kv_writes == writes * num_layers, f"{calls} has not {writes // 2} {CTX_SCATTER[cb]} per K and V"
    assert calls.get(CTX_GATHER[cb], 0) >= 2 * num_layers, f"{calls} has not a {CTX_GATHER[cb]} per K and V read"
    if mask and cb:
        assert calls.get(CTX_SCATTER[False], 0) == num_layers, f"{calls} has not one mask CtxScatter per layer"
    variants = {CTX_SCATTER[cb], CTX_GATHER[cb], *mask}
    assert set(calls) == variants, f"{calls}: another variant's function in the graph"
    defined = {(f.domain, f.name) for f in proto.functions if f.node}
    missing = sorted(name for name in calls if (CTX_DOMAIN, name) not in defined)
    assert not missing, f"the graph calls {missing} without defining them"
    assert any(o.domain == CTX_DOMAIN for o in proto.opset_import), f"no opset import of {CTX_DOMAIN}"


def check_graph(path: Path, num_layers: int, options: ExportOptions, *, latent: bool = False) -> None:
    """Full ``onnx.checker`` pass, the contract's names and symbolic dimensions, and the KV's Ctx functions."""
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    check_ctx_functions(path, num_layers, options)
    dims = graph_dims(path)
    vocab = dims[contract.LOGITS][-1]
    expected = expected_dims(num_layers, options, vocab, latent=latent)
    assert list(dims) == list(expected), f"graph I/O {list(dims)} differs from the contract {list(expected)}"
    for name, want in expected.items():
        got = dims[name]
        ok = len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))
        assert ok, f"{name} has dims {got}, the contract says {want}"
