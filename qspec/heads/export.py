"""Draft heads as ONNX graphs of the qspec contract.

**EAGLE-1**, KV-explicit like the target (:class:`~qspec.export.wrapper.KVExplicitLM`'s prologue and
layer step, reused: the call's KV is written at ``position_ids``, ``PAD_POSITION`` pads, the mask comes
from positions)::

    input_ids [batch_size, seq_len], position_ids [batch_size, seq_len],
    hidden_states [batch_size, seq_len, hidden], (batch_index [batch_size, 1]),
    past_key.0 / past_value.0 [batch_size or full_batch_size, kv_heads, ctx_len, head_dim]
      -> logits [batch_size, keep, draft_vocab]        each row's last ``keep`` real tokens
         hidden_states_out [batch_size, keep, hidden]  the head's features there (the next call's input)
         past_key.0_RetainedState / past_value.0_RetainedState

Row ``i`` of a call pairs the target's (or the previous call's) feature at position ``p_i - 1`` with the
token at ``p_i`` (see :mod:`qspec.heads.modules` for EAGLE's position convention). ``keep`` is 1, or a
parallel head's depth (:mod:`qspec.heads.parallel`): one call's mask pairs draft that many tokens, so the vendor
graph hands out its last ``depth`` rows (a row with fewer repeats its first), as QEfficient's speculative target
hands out its last ``num_logits_to_keep``.

**Medusa** (and turbo): ``hidden_states [batch_size, 1, hidden] -> logits [batch_size, num_heads,
draft_vocab]``; no KV.

Weights: the graph computes in float32; every large float initializer is stored as float16 behind a
``Cast`` (the embedding table alone is ``vocab x hidden``), and ``int8``/``int4`` first turn the MatMul
weights into ``MatMulNBits`` with the target's quantizer settings.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qspec import contract

# Float initializers of at least this many elements are stored as float16.
FP16_MIN_ELEMENTS = 1024


# Wrappers --------------------------------------------------------------------------------------------


class _Decoder(nn.Module):
    """What :class:`KVExplicitLM` reads of a Hugging Face model: ``config`` and ``model.{embed_tokens,
    layers, rotary_emb}``."""

    def __init__(self, head):
        super().__init__()
        self.config = head.config
        self.model = nn.Module()
        self.model.embed_tokens = head.embed_tokens
        self.model.layers = head.layers
        self.model.rotary_emb = head.rotary_emb


class EagleKVExplicit(nn.Module):
    """``forward(input_ids, position_ids, hidden_states, [batch_index], past_key, past_value)
    -> logits, hidden_states_out, past_key', past_value'``."""

    def __init__(self, head, *, continuous_batching: bool, keep: int = 1):
        super().__init__()
        from qspec.export.wrapper import KVExplicitLM

        self.lm = KVExplicitLM(_Decoder(head), continuous_batching=continuous_batching, speculative=False)
        self.fc = head.fc
        self.lm_head = head.lm_head
        self.continuous_batching = continuous_batching
        self.keep = keep

    def forward(self, *args):
        input_ids, position_ids, hidden_states, *rest = args
        batch_index = rest[0] if self.continuous_batching else None  # [batch, 1]
        past_key, past_value = rest[-2:]
        embeds, cos, sin, query_pos, anchor, valid = self.lm.prologue(input_ids, position_ids)
        x = self.fc(torch.cat((embeds, hidden_states.to(embeds.dtype)), dim=-1))  # [batch, seq, hidden]
        x, keys, values = self.lm.layer_step(
            0, x, cos, sin, query_pos, anchor, valid, batch_index, past_key, past_value
        )
        feature = _last_real(x, valid, self.keep)  # [batch, keep, hidden]
        return self.lm_head(feature).float(), feature, keys, values


class Eagle3KVExplicit(EagleKVExplicit):
    """EAGLE-3's step (vLLM ``llama_eagle3.py``): q/k/v read ``cat(input_layernorm(embed), hidden_norm(f))``,
    the residual is ``f`` (or its norm with ``norm_before_residual``); logits through ``norm``, and the pre-norm
    output is the chained feature. The target graph already applied ``fc``."""

    def __init__(self, head, *, continuous_batching: bool, keep: int = 1):
        super().__init__(head, continuous_batching=continuous_batching, keep=keep)
        self.norm = head.norm
        self.step_input = head.step_input

    def forward(self, *args):
        input_ids, position_ids, hidden_states, *rest = args
        batch_index = rest[0] if self.continuous_batching else None  # [batch, 1]
        past_key, past_value = rest[-2:]
        embeds, cos, sin, query_pos, anchor, valid = self.lm.prologue(input_ids, position_ids)
        residual, x = self.step_input(embeds, hidden_states.to(embeds.dtype))  # [batch, seq, hidden], [.., 2 hidden]
        out, keys, values = self.lm.layer_step(
            0, residual, cos, sin, query_pos, anchor, valid, batch_index, past_key, past_value, attn_input=x
        )
        feature = _last_real(out, valid, self.keep)  # [batch, keep, hidden]
        return self.lm_head(self.norm(feature)).float(), feature, keys, values


def _last_real(x: torch.Tensor, valid: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """``x`` at the last ``keep`` live steps of each (right-padded) row: ``[batch, keep, width]``; a row with
    fewer live steps repeats its first."""
    batch, seq, width = x.shape
    steps = torch.arange(seq, dtype=torch.int64)
    last = (valid.to(torch.int64) * steps).amax(dim=1, keepdim=True)  # [batch, 1]
    if keep > 1:
        last = (last + torch.arange(1 - keep, 1, dtype=torch.int64)).clamp(min=0)  # [batch, keep]
    return x.gather(1, last.unsqueeze(-1).expand(batch, keep, width))


class MedusaGraph(nn.Module):
    """``forward(hidden_states [batch, 1, hidden]) -> logits [batch, num_heads, draft_vocab]``."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, *args):
        return self.head(args[0])[:, 0].float()


# Contract of the head graphs -------------------------------------------------------------------------


def eagle_input_names(*, continuous_batching: bool) -> list[str]:
    names = [contract.INPUT_IDS, contract.POSITION_IDS, contract.HIDDEN_STATES]
    if continuous_batching:
        names.append(contract.BATCH_INDEX)
    return names + contract.kv_names(1)


def eagle_output_names() -> list[str]:
    return [contract.LOGITS, contract.HIDDEN_STATES_OUT] + [contract.retained(n) for n in contract.kv_names(1)]


def eagle_dims(head, *, continuous_batching: bool, keep: int = 1) -> dict[str, list]:
    """Dimension names (or sizes) of every input and output of an EAGLE head graph (``keep`` rows a row out)."""
    tokens = [contract.BATCH_SIZE, contract.SEQ_LEN]
    rows = contract.FULL_BATCH_SIZE if continuous_batching else contract.BATCH_SIZE
    attn = head.layers[0].self_attn
    kv = [rows, head.config.num_key_value_heads, contract.CTX_LEN, attn.head_dim]
    hidden = head.config.hidden_size
    dims = {
        contract.INPUT_IDS: tokens,
        contract.POSITION_IDS: tokens,
        contract.HIDDEN_STATES: [*tokens, hidden],
    }
    if continuous_batching:
        dims[contract.BATCH_INDEX] = [contract.BATCH_SIZE, 1]
    dims |= {name: kv for name in contract.kv_names(1)}
    dims[contract.LOGITS] = [contract.BATCH_SIZE, keep, head.draft_vocab_size]
    dims[contract.HIDDEN_STATES_OUT] = [contract.BATCH_SIZE, keep, hidden]
    return dims | {contract.retained(name): kv for name in contract.kv_names(1)}


def head_keep(head) -> int:
    """Rows a call of ``head``'s graph hands out per row: a parallel head's depth, else 1."""
    parallel = getattr(head, "parallel", None)
    return parallel.depth if parallel is not None else 1


def eagle_attention_info(head):
    """The :class:`~qspec.package.AttentionInfo` of an EAGLE head's one layer (what its fused runtime graph
    reads: heads, scale, RoPE)."""
    from qspec.export.wrapper import attention_info

    return attention_info(_Decoder(head))


def medusa_dims(head) -> dict[str, list]:
    return {
        contract.HIDDEN_STATES: [contract.BATCH_SIZE, 1, head.hidden_size],
        contract.LOGITS: [contract.BATCH_SIZE, head.num_heads, head.draft_vocab_size],
    }


# Tracing ---------------------------------------------------------------------------------------------


def trace_eagle(head, *, continuous_batching: bool, eagle3: bool = False):
    """The EAGLE-1 (or EAGLE-3) head as an ``onnx_ir`` model, float32 weights in memory; a parallel head's keeps
    its depth's rows a call (module doc)."""
    from qspec.export.wrapper import hold_weights_input_major

    keep = head_keep(head)
    dims = eagle_dims(head, continuous_batching=continuous_batching, keep=keep)
    head = copy.deepcopy(head).float().eval()
    hold_weights_input_major(head)  # MatMul(x, W[in, out]): no Transpose to fold, quantizable as is
    kind = Eagle3KVExplicit if eagle3 else EagleKVExplicit
    wrapper = kind(head, continuous_batching=continuous_batching, keep=keep).eval()
    kv_heads, width = head.config.num_key_value_heads, head.layers[0].self_attn.head_dim
    return export_kv_explicit(wrapper, head.config.hidden_size, (kv_heads, width), dims, continuous_batching)


def export_kv_explicit(wrapper, hidden_size: int, kv: tuple[int, int], dims: dict, continuous_batching: bool):
    """Trace a one-layer head ``wrapper`` with EAGLE's inputs (ids, positions, hidden states, batch index, its
    one-layer KV of ``kv`` = (heads, head_dim)) and outputs, symbolic dimensions named by ``dims``."""
    from torch.export import Dim

    batch, seq, ctx, rows = 3, 5, 19, 7  # distinct sizes, none equal to a fixed dimension
    cache = torch.zeros(rows if continuous_batching else batch, kv[0], ctx, kv[1])
    b, s = Dim(contract.BATCH_SIZE, min=1), Dim(contract.SEQ_LEN, min=1)
    kv_rows = Dim(contract.FULL_BATCH_SIZE, min=1) if continuous_batching else b
    kv_shape = {0: kv_rows, 2: Dim(contract.CTX_LEN, min=2)}
    examples = [
        torch.zeros(batch, seq, dtype=torch.int64),
        torch.arange(seq).repeat(batch, 1),
        torch.zeros(batch, seq, hidden_size),
    ]
    shapes = [{0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}]
    if continuous_batching:
        examples.append(torch.arange(batch, dtype=torch.int64)[:, None] * 2 % rows)
        shapes.append({0: b})
    examples += [cache, cache.clone()]
    shapes += [kv_shape, kv_shape]
    names = eagle_input_names(continuous_batching=continuous_batching), eagle_output_names()
    model = _export(wrapper, examples, shapes, *names)
    _name_dims(model, dims)
    return model


def trace_medusa(head):
    """The Medusa (or turbo) heads as an ``onnx_ir`` model, float32 weights in memory."""
    from torch.export import Dim

    from qspec.export.wrapper import hold_weights_input_major

    dims = medusa_dims(head)
    head = copy.deepcopy(head).float().eval()
    hold_weights_input_major(head)
    example = torch.zeros(3, 1, head.hidden_size)
    model = _export(
        MedusaGraph(head),
        [example],
        [{0: Dim(contract.BATCH_SIZE, min=1)}],
        [contract.HIDDEN_STATES],
        [contract.LOGITS],
    )
    _name_dims(model, dims)
    return model


def _export(module: nn.Module, examples: list, shapes: list, input_names: list[str], output_names: list[str]):
    from qspec.export import ctx_functions
    from qspec.export.exporter import OPSET, _quiet

    with _quiet(), torch.no_grad():
        program = torch.onnx.export(
            module,
            tuple(examples),
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=(tuple(shapes),),  # forward(*args)
            dynamo=True,
            opset_version=OPSET,
            optimize=True,
            verbose=False,
            custom_translation_table=ctx_functions.translation_table(),  # an EAGLE layer's KV write and read
        )
    ctx_functions.attach(program.model)
    return program.model


def _name_dims(model, dims: dict[str, list]) -> None:
    """Give every graph input and output the contract's dimension names."""
    import onnx_ir as ir

    values = (*model.graph.inputs, *model.graph.outputs)
    assert [v.name for v in values] == list(dims), f"head graph I/O {[v.name for v in values]} != {list(dims)}"
    for value in values:
        value.shape = ir.Shape(dims[value.name])


# Weights ---------------------------------------------------------------------------------------------


def quantize_copy(model, bits: int):
    """A copy of ``model`` with its MatMul weights as ``MatMulNBits`` (the target's block size, accuracy
    level and symmetry); returns (copy, how many). ``model`` is left as it is."""
    import onnx_ir as ir

    from qspec.backends.ort_quantize import quantize_matmuls

    proto, count = quantize_matmuls(ir.to_proto(model), bits)
    return ir.from_proto(proto), count


def store_float16(model) -> int:
    """Store every float32 initializer of ``FP16_MIN_ELEMENTS`` or more as float16 behind a ``Cast`` to
    float32 (quantized weights' scales stay as they are); returns how many.

    A table only ``Gather`` reads (the target's embedding) is gathered as float16 and the rows cast:
    the same values, and ONNX Runtime cannot fold a ``Cast`` of the whole table into a float32 copy
    at load (``vocab x hidden x 4`` bytes, 113 MB for SmolLM2, in every head session)."""
    import onnx_ir as ir

    graph = model.graph
    first = next(iter(graph))
    count = 0
    for value in list(graph.initializers.values()):
        uses = list(value.uses())
        if (
            value.dtype != ir.DataType.FLOAT
            or value.const_value.size < FP16_MIN_ELEMENTS
            or any(node.op_type == "MatMulNBits" for node, _ in uses)
        ):
            continue
        half = value.const_value.numpy().astype(np.float16)
        stored = ir.Value(
            name=f"{value.name}.fp16",
            shape=value.shape,
            type=ir.TensorType(ir.DataType.FLOAT16),
            const_value=ir.Tensor(half, name=f"{value.name}.fp16"),
        )
        graph.register_initializer(stored)
        if uses and all(node.op_type == "Gather" and index == 0 for node, index in uses):
            for gather, _ in uses:
                _cast_rows(graph, gather, stored)
        else:
            cast = ir.node("Cast", [stored], attributes={"to": ir.DataType.FLOAT})
            graph.insert_before(first, cast)
            value.replace_all_uses_with(cast.outputs[0])
            cast.outputs[0].name = value.name
        graph.initializers.pop(value.name)
        count += 1
    return count


def _cast_rows(graph, gather, table) -> None:
    """``gather`` reads ``table`` (float16) instead of its float32 copy; a ``Cast`` after it gives its
    users the float32 rows under the name they read."""
    import onnx_ir as ir

    rows = gather.outputs[0]
    users = list(rows.uses())
    gather.replace_input_with(0, table)
    cast = ir.node("Cast", [rows], attributes={"to": ir.DataType.FLOAT})
    graph.insert_after(gather, cast)
    for user, index in users:
        user.replace_input_with(index, cast.outputs[0])
    if rows.is_graph_output():
        graph.outputs[graph.outputs.index(rows)] = cast.outputs[0]
    name, rows.name = rows.name, f"{rows.name}.fp16"
    cast.outputs[0].name = name
    cast.outputs[0].type, cast.outputs[0].shape = rows.type, rows.shape
    rows.type = ir.TensorType(ir.DataType.FLOAT16)


def save(model, path: Path, *, check: bool = True) -> None:
    """Write the graph and its weights (external data ``<path>.data``); check it with ``onnx.checker`` unless
    ``check`` is False (a runtime graph with ONNX Runtime's ``SimplifiedLayerNormalization``, which ONNX Runtime
    registers in the default domain and the checker does not know: the compile runs it in a session instead)."""
    import onnx
    import onnx_ir as ir

    ir.save(model, str(path), external_data=path.name + ".data")
    if check:
        onnx.checker.check_model(str(path), full_check=True)


def graph_bytes(path: Path) -> int:
    """Bytes of a saved graph and its external data."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data")) if p.is_file())
