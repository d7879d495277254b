"""Attention for the embedded backend: each layer's attention as one ``GroupQueryAttention`` node.

The vendor graph computes attention the way the contract states it, in plain ONNX ops: RoPE, the KV
of the call's tokens written at ``position_ids`` (``ScatterElements``), a mask from positions, two
MatMuls and a softmax: about 45 nodes per layer. On the CPU a decode call spends most of its time
beyond the weights launching nodes (measured: ≈ 1,800 nodes per SmolLM2 int4 call, 372 after this).
ONNX Runtime's ``com.microsoft.GroupQueryAttention`` does the same work in one node, with the KV
buffer shared between ``past`` and ``present`` (the runtime binds both to one OrtValue) and its
right-padded chunk form (``query_seqlens``). Mapping the contract onto it, per row of a call:

- every node but attention runs on the call's **live tokens** only. With several KV slots
  (``pack_tokens``): the embedding reads their ids (``NonZero`` of ``position_ids >= 0``), the
  MatMuls, norms and MLP see ``[1, live, width]``, and the final norm and LM head run on the live
  tokens whose logits the call keeps, scattered to ``[batch, keep, vocab]``; attention scatters the
  live tokens' q, k, v to ``[kv_rows, query, width]`` zeros (``ScatterND``) and gathers its output
  back (``GatherND``). At one slot (``trim_rows``): each row is cut to the call's most live tokens in
  a row (rows are right-padded) before the embedding, and the final norm and LM head run on the last
  kept tokens only; per layer only attention's padding moves tokens (below). A row padded to the
  call's ``seq_len`` (a batch-4 K=4 call where one row drafts: 8 live tokens of 20), or a draft
  shorter than its K, costs what its live tokens cost.
- the op sees ``query = max(seq_len, MIN_QUERY_TOKENS)`` tokens per row, and a live row runs
  ``max(n, MIN_QUERY_TOKENS)`` of them (``query_seqlens``): a one-token row gets one zero token.
  ONNX Runtime's CPU kernel takes another path for a single query token, whose rounding differs from
  the same token's row in a several-token call (measured on SmolLM2: 3e-8 after the first layer,
  3e-5 on fp32 logits, 0.5 on int4 logits once int8 activation quantization rounds the difference
  up). With the zero token, a token's logits in a K=0 call equal, bit for bit, its row in a K + 1
  verify call, so speculative greedy output is plain greedy output. A package without drafts has no
  verify call to match: its graph (``lone_query``, one KV slot) runs a one-token row alone.
- a row with live tokens at positions ``p .. p + n - 1`` (consecutive, as the contract requires) runs
  as a chunk from ``p``: ``seqlens_k = p + max(n, MIN_QUERY_TOKENS) - 1``. Its live tokens are
  written at their positions, rotated by them and see slots ``[0, position]`` (and their window), as
  in the vendor graph. A zero token follows at ``p + 1`` like a rejected draft: written past the
  row's last live slot, where nothing is read before a later live token rewrites it.
- a row with no live token is idle (``query_seqlens = 0``): its cache is not touched and no node
  after attention reads its output.
- at one KV slot (``trim_rows``) these per-call integers are the host's call plan, graph inputs
  (:mod:`qspec.backends.ort_plan`); with several slots the graph computes them from ``position_ids``.

The op wants room for the whole chunk, ``p + query <=`` the buffer's length, and RoPE rows for
every position it rotates. The runtime gives such a graph KV buffers ``query`` slots longer than
``ctx_len`` (:meth:`qspec.package.RuntimeGraph.kv_slack`), and the RoPE table has
``rope_positions >= ctx_len + query`` rows; live positions stay below ``ctx_len``.

The rewrite reads the layer's projections by their weight names (``model.layers.{i}.self_attn.*``,
the names the exporter keeps) and RoPE, heads and windows from the export's
:class:`~qspec.package.AttentionInfo`.

Continuous batching (``batch_index`` picks the KV row of each of the call's rows): the op's batch is
the KV rows; the live tokens are scattered to their KV rows and slots, the other KV rows are idle.
Only attention's inputs and output move, a few ``[rows, query, width]`` copies per layer, never the
KV cache. Without ``pack_tokens`` (one slot) a one-token call's q, k, v are padded (``Pad``) and its
output sliced back. (Running that extra token through every layer instead, as the embedding's second
token, measured 5 % slower on fp32 and int4 K=0 calls: MatMuls of two rows cost more than one row's.)
"""

from __future__ import annotations

import numpy as np

from qspec import contract
from qspec.backends import ort_plan, ort_tokens
from qspec.backends.ort_attention_nodes import (
    full_norm,
    head_norm,
    packed_qkv,
    pad_tokens,
    projection_outputs,
    retain,
    to_kv_rows,
    to_kv_slots,
    to_op_slots,
    tree_inputs,
)
from qspec.backends.ort_tokens import builder
from qspec.package import MIN_QUERY_TOKENS, AttentionInfo

MS_DOMAIN = "com.microsoft"
LAYER_PREFIX = "model.layers.{i}.self_attn."


def rope_tables(attention: AttentionInfo, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos_cache``, ``sin_cache`` ``[rows, head_dim / 2]`` for positions ``0 .. rows - 1``, RoPE scaling folded in."""
    inv_freq = np.asarray(attention.inv_freq, dtype=np.float32)
    positions = np.arange(rows, dtype=np.float32)[:, None]
    freqs = positions * inv_freq[None, :]
    scale = np.float32(attention.rope_scaling)
    return (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)


def fuse_attention(
    model,
    attention: AttentionInfo,
    rope_positions: int,
    *,
    pack_qkv: bool = False,
    pack_tokens: bool = False,
    trim_rows: bool = False,
    host_plan: bool = False,
    lone_query: bool = False,
    tree: bool = False,
    layer_prefix: str = LAYER_PREFIX,
) -> int:
    """Replace every layer's attention of an ``onnx_ir`` model with ``GroupQueryAttention``; returns how many.

    ``rope_positions``: rows of the RoPE table, at least ``ctx_len`` plus the longest ``seq_len``.
    ``pack_qkv``: one MatMul for q, k and v (their weights side by side, fed to the op as packed QKV):
    one MatMul and one ``Pad`` per layer instead of three each (fp32 SmolLM2: 60 + 60 nodes fewer per
    call). Each output column is computed alone (a block-wise quantizer also quantizes each column on
    its own, so a packed weight quantizes to the same values). Not with q/k norm.
    ``pack_tokens``: every node but attention runs on the call's live tokens only (see
    :func:`pack_live_tokens`). ``trim_rows`` (a graph without ``batch_index``): every node but
    attention runs on each row's first live tokens, as many as the call's longest row has (see
    :func:`trim_rows`).
    ``host_plan`` (a graph without ``batch_index``, rows not trimmed): attention's integers are the host's
    call plan (:func:`qspec.backends.ort_plan.add_inputs` with ``cut=False``), as with ``trim_rows``.
    ``lone_query`` (with ``trim_rows`` or ``host_plan``): a one-token call's attention runs its token alone,
    without the exactness pad (no ``Pad``/``Slice`` per layer): for a package without drafts, where no verify
    call's rounding must be matched (ONNX Runtime's kernel rounds a lone query differently, see the module
    doc), and for a draft head, whose drafts the target verifies.
    ``tree`` (not with ``lone_query`` or ``host_plan``): a verify row may be a tree of drafts
    (:mod:`qspec.runtime.layout`): the op rotates each token by its position (``position_ids``) and an additive
    bias hides a token's non-ancestors (:func:`~qspec.backends.ort_attention_nodes.tree_inputs`).
    ``layer_prefix``: where layer ``{i}``'s projections are (a draft head's graph holds its layer under
    another module path than the target's ``model.layers.{i}.self_attn.``).
    """
    import onnx_ir as ir

    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    producers = projection_outputs(graph)
    by_index = contract.BATCH_INDEX in inputs
    if (trim_rows or host_plan) and (by_index or pack_tokens):
        raise ValueError("trim_rows and host_plan are for a graph without batch_index, and not with pack_tokens")
    if trim_rows and host_plan:
        raise ValueError("trim_rows already takes the host's plan: give one of trim_rows and host_plan")
    if lone_query and not (trim_rows or host_plan):
        raise ValueError("lone_query is for a graph with trim_rows or host_plan")
    if host_plan and not lone_query:
        raise ValueError("host_plan runs a lone query: give lone_query too")
    if tree and (lone_query or not trim_rows):
        raise ValueError("tree is for a graph with trim_rows that verifies drafts (not lone_query)")
    shared = _shared_inputs(
        graph,
        inputs,
        attention,
        rope_positions,
        packed=pack_tokens,
        trimmed=trim_rows,
        planned=host_plan,
        lone_query=lone_query,
        tree=tree,
    )
    padded = not lone_query
    if tree:
        shared |= tree_inputs(graph, inputs[contract.POSITION_IDS], shared, attention)
    outputs = {value.name: (i, value) for i, value in enumerate(graph.outputs)}
    nodes = []
    for i in range(attention.num_layers):
        prefix = layer_prefix.format(i=i)
        o_proj = producers[prefix + "o_proj"].producer()  # its MatMul reads the attention output
        heads = [attention.num_heads, attention.num_kv_heads, attention.num_kv_heads]
        if prefix + "qkv_proj" in producers:  # a fused projection (Phi-3) is the op's packed QKV as it is
            q, k, v, heads = producers[prefix + "qkv_proj"], None, None, [sum(heads), 0, 0]
        else:
            q, k, v = (producers[prefix + name] for name in ("q_proj", "k_proj", "v_proj"))
        if attention.qk_norm:  # per-head RMSNorm before RoPE (the CPU kernel has no q/k norm inputs)
            q, k = (
                head_norm(graph, nodes, x, prefix + name, attention, n)
                for x, name, n in ((q, "q_norm", attention.num_heads), (k, "k_norm", attention.num_kv_heads))
            )
        if attention.qk_norm_full:  # over all heads at once (OLMo 2)
            q, k = (
                full_norm(nodes, x, graph.initializers[prefix + name + ".weight"], attention)
                for x, name in ((q, "q_norm"), (k, "k_norm"))
            )
        if pack_qkv and not (attention.qk_norm or attention.qk_norm_full) and k is not None:
            q, k, v, heads = packed_qkv(graph, nodes, (q, k, v), prefix), None, None, [sum(heads), 0, 0]
        if pack_tokens:  # the call's live tokens to their KV rows and slots, zero tokens up to `query` per row
            q, k, v = (
                to_kv_slots(nodes, x, shared["zeros"][n * attention.head_dim], shared, f"layers.{i}.{name}")
                if x is not None
                else None
                for x, n, name in zip((q, k, v), heads, "qkv")
            )
        elif by_index:  # the call's rows to their KV rows; the other KV rows are idle in this call
            q, k, v = (
                to_kv_rows(nodes, x, shared["zeros"][n * attention.head_dim], shared, f"layers.{i}.{name}")
                if x is not None
                else None
                for x, n, name in zip((q, k, v), heads, "qkv")
            )
        if tree:  # each token to its op slot (ScatterND in place of the Pad: holes before an off-chain draft)
            q, k, v = (
                to_op_slots(nodes, x, shared["op_zeros"][n * attention.head_dim], shared, f"layers.{i}.{name}")
                if x is not None
                else None
                for x, n, name in zip((q, k, v), heads, "qkv")
            )
        elif not pack_tokens and padded:
            q, k, v = (
                pad_tokens(nodes, x, shared, f"layers.{i}.{name}") if x is not None else None
                for x, name in zip((q, k, v), "qkv")
            )
        past_key, past_value = inputs[contract.past_key(i)], inputs[contract.past_value(i)]
        gqa = ir.node(
            "GroupQueryAttention",
            [
                q,
                k,
                v,
                past_key,
                past_value,
                shared["seqlens_k"],
                shared["total_sequence_length"],
                shared["cos_cache"],
                shared["sin_cache"],
                shared.get("op_positions"),  # None: token s of a row is at p + s (seqlens_k + 1 - seq_len + s)
                shared.get("tree_bias"),  # None: causal over the row's slots
                None,  # head_sink
                None,  # k_scale
                None,  # v_scale
                None,  # q_norm_weight (CUDA / WebGPU only)
                None,  # k_norm_weight
                shared["query_seqlens"],
            ],
            attributes={
                "num_heads": attention.num_heads,
                "kv_num_heads": attention.num_kv_heads,
                "scale": float(attention.scale),
                "do_rotary": 1,
                "rotary_interleaved": 0,
                "local_window_size": attention.windows[i] if attention.windows[i] is not None else -1,
                "softcap": float(attention.softcap),
            },
            domain=MS_DOMAIN,
            num_outputs=3,
            name=f"layers.{i}.attention",
        )
        nodes.append(gqa)
        if pack_tokens:  # back to the live tokens, [1, live, width]
            back = ir.node("GatherND", [gqa.outputs[0], shared["kv_slots"]], name=f"layers.{i}.live_tokens")
            nodes.append(back)
            o_proj.replace_input_with(0, back.outputs[0])
            retain(graph, outputs, (past_key, gqa.outputs[1]), (past_value, gqa.outputs[2]))
            continue
        attended = gqa.outputs[0]
        if tree:  # back from the op slots to the row's tokens
            back = ir.node("GatherND", [attended, shared["op_index"]], name=f"layers.{i}.own_tokens")
            nodes.append(back)
            attended = back.outputs[0]
        elif padded:  # the call's own tokens: drop the op's padding token (see MIN_QUERY_TOKENS)
            sliced = ir.node(
                "Slice", [attended, shared["zero_1d"], shared["seq_1d"], shared["axis1"]], name=f"layers.{i}.own_tokens"
            )
            nodes.append(sliced)
            attended = sliced.outputs[0]
        if by_index:  # back from KV rows to the call's rows
            back = ir.node("Gather", [attended, shared["call_rows"]], attributes={"axis": 0}, name=f"layers.{i}.rows")
            nodes.append(back)
            attended = back.outputs[0]
        o_proj.replace_input_with(0, attended)  # an idle row's rows stay unspecified (see the module doc)
        retain(graph, outputs, (past_key, gqa.outputs[1]), (past_value, gqa.outputs[2]))
    graph.extend(nodes)
    if pack_tokens:
        ort_tokens.pack_live_tokens(graph, inputs, shared)
    if trim_rows:
        ort_tokens.trim_rows(graph, inputs, shared)
    for name in _feature_outputs(outputs) if (pack_tokens or trim_rows) else ():
        ort_tokens.restore_hidden_states(graph, inputs, shared, packed=pack_tokens, name=name)
    graph.sort()
    model.opset_imports[MS_DOMAIN] = 1
    from onnxscript import optimizer

    optimizer.remove_unused_nodes(model)
    if (pack_tokens or trim_rows) and len(inputs[contract.INPUT_IDS].uses()) != 1:  # the exported attention's are gone
        raise ValueError("packing or trimming tokens: input_ids is still read by more than the embedding's input")
    for name, value in list(graph.initializers.items()):  # the q, k, v weights a packed graph no longer reads
        if not value.uses() and value not in graph.outputs:
            graph.initializers.pop(name)
    return attention.num_layers


def _shared_inputs(
    graph,
    inputs,
    attention: AttentionInfo,
    rope_positions: int,
    *,
    packed: bool = False,
    trimmed: bool = False,
    planned: bool = False,
    lone_query: bool = False,
    tree: bool = False,
) -> dict[str, object]:
    """What every layer's attention reads, computed once from ``position_ids`` (a dozen nodes).

    ``packed``: also where each live token of the call goes (``live_tokens``: its call row and slot,
    ``kv_slots``: its KV row and slot, both ``[1, live, 2]``), and zeros ``[kv_rows, query, width]``.
    ``trimmed``: no nodes: the host computes them (:mod:`qspec.backends.ort_plan`'s inputs, ``plan``);
    ``seq`` is the call's most live tokens in a row (at least one), not ``seq_len``, and ``query`` at
    least ``MIN_QUERY_TOKENS`` of them (see :func:`trim_rows`). ``planned``: the host's plan too, for rows
    that are not cut (attention's integers only).
    """
    import onnx_ir as ir

    nodes = []
    op, constant = builder(graph, nodes, "attn")
    cos, sin = rope_tables(attention, rope_positions)
    if trimmed or planned:
        hidden = bool(_feature_outputs([v.name for v in graph.outputs]))
        plan = ort_plan.add_inputs(graph, hidden_states=hidden, query_pads=not lone_query, cut=trimmed, tree=tree)
        return {
            "plan": plan,
            "query_pads": plan.get(ort_plan.QUERY_PADS),
            "zero_1d": constant("zero_1d", np.array([0], np.int64)),
            "seq_1d": plan.get(ort_plan.SEQ),
            "axis1": constant("axis1", np.array([1], np.int64)),
            "seqlens_k": plan[ort_plan.SEQLENS_K],
            "query_seqlens": plan[ort_plan.QUERY_SEQLENS],
            "total_sequence_length": plan[ort_plan.TOTAL_SEQUENCE_LENGTH],
            "cos_cache": constant("cos_cache", cos),
            "sin_cache": constant("sin_cache", sin),
        }
    positions = inputs[contract.POSITION_IDS]
    zero, one = constant("zero", np.array(0, np.int64)), constant("one", np.array(1, np.int64))
    axis0 = constant("axis0", np.array([0], np.int64))
    axis1 = constant("axis1", np.array([1], np.int64))

    seq = op("Gather", op("Shape", positions), one)  # scalar
    # The op's tokens per row: seq, at least MIN_QUERY_TOKENS (q, k, v padded with zero tokens).
    min_query = constant("min_query", np.array(MIN_QUERY_TOKENS, np.int64))
    query = op("Max", seq, min_query)
    extra = {}
    batch_index = inputs.get(contract.BATCH_INDEX)
    call_rows = op("Squeeze", batch_index, axis1) if batch_index is not None else None
    kv_rows = op("Gather", op("Shape", inputs[contract.past_key(0)]), zero)
    if packed:
        live = op("Transpose", op("NonZero", op("GreaterOrEqual", positions, zero)))  # [live, 2]: row, slot
        live_rows, live_slots = (op("Gather", live, index, axis=1) for index in (zero, one))  # [live] each
        kv_slots = live  # without batch_index a call row is its KV row
        if call_rows is not None:
            kv_row = op("Gather", call_rows, live_rows)
            kv_slots = op("Concat", op("Unsqueeze", kv_row, axis1), op("Unsqueeze", live_slots, axis1), axis=1)
        extra = {
            "live_tokens": op("Unsqueeze", live, axis0),
            "live_rows": live_rows,
            "live_slots": live_slots,
            "kv_slots": op("Unsqueeze", kv_slots, axis0),
        }
    if batch_index is not None:
        # Continuous batching: the call's rows are KV rows batch_index; attention runs over every KV
        # row, those not in the call idle (all positions PAD_POSITION), its inputs scattered there.
        full = op("Concat", op("Unsqueeze", kv_rows, axis0), op("Unsqueeze", seq, axis0), axis=0)  # [kv_rows, seq]
        pad = constant("pad", np.array(contract.PAD_POSITION, np.int64))
        positions = op("ScatterND", op("Expand", pad, full), batch_index, positions)
        extra |= {"batch_index": batch_index, "call_rows": call_rows}
    if batch_index is not None or packed:
        # zeros [kv_rows, seq, width] for the call's rows, or [kv_rows, query, width] for its live tokens
        # (the op's zero tokens come with the scatter: no Pad)
        width = query if packed else seq
        full = op("Concat", op("Unsqueeze", kv_rows, axis0), op("Unsqueeze", width, axis0), axis=0)
        zero_f = constant("zero_float_1d", np.zeros(1, np.float32))
        heads = (attention.num_heads, attention.num_kv_heads, attention.num_heads + 2 * attention.num_kv_heads)
        widths = {n * attention.head_dim for n in heads}  # q, k and v, or packed QKV
        extra["zeros"] = {
            w: op("Expand", zero_f, op("Concat", full, constant(f"width{w}", np.array([w], np.int64)), axis=0))
            for w in sorted(widths)
        }
    row_valid = op("GreaterOrEqual", positions, zero)  # [rows, seq]: the op's rows (KV rows with batch_index)
    count = op("ReduceSum", op("Cast", row_valid, to=ir.DataType.INT64), axis1, keepdims=0)
    live_row = op("Greater", count, zero)
    pad_end = op("Unsqueeze", op("Sub", query, seq), axis0)
    zero_1d = constant("zero_1d", np.array([0], np.int64))
    pads_begin = constant("pads_begin", np.zeros(4, np.int64))
    pads = op("Concat", pads_begin, pad_end, zero_1d, axis=0)  # [0, 0, 0, 0, query - seq, 0]
    # A live row runs its live tokens, at least MIN_QUERY_TOKENS, from its first live position p (its first
    # slot: rows are right-padded, a tree's siblings share positions but not slots): T = p + row_query.
    row_query = op("Max", count, min_query)
    first = op("Gather", positions, zero, axis=1)  # [rows]
    seqlens_k = op("Where", live_row, op("Sub", op("Add", first, row_query), one), zero)
    query_seqlens = op("Where", live_row, row_query, zero)
    total = op("Max", op("Add", op("ReduceMax", seqlens_k, keepdims=0), one), query)  # >= every T and query
    shared = {
        "row_positions": positions,  # [the op's rows, seq]
        "query_pads": pads,
        "zero_1d": zero_1d,
        "seq_1d": op("Unsqueeze", seq, axis0),
        "axis1": axis1,
        "seqlens_k": op("Cast", seqlens_k, to=ir.DataType.INT32),
        "query_seqlens": op("Cast", query_seqlens, to=ir.DataType.INT32),
        "total_sequence_length": op("Cast", total, to=ir.DataType.INT32),
        "cos_cache": constant("cos_cache", cos),
        "sin_cache": constant("sin_cache", sin),
        **extra,
    }
    graph.extend(nodes)
    return shared


def _feature_outputs(names) -> list[str]:
    """The per-token outputs a draft head reads: ``hidden_states`` and the taps (``tap.{i}``, qspec.export.taps)."""
    from qspec.export.graph import TAP_PREFIX

    return [name for name in names if name == contract.HIDDEN_STATES or name.startswith(TAP_PREFIX)]
