"""An MTP layer (:mod:`qspec.heads.mtp`) as an ONNX graph of the qspec contract: one graph per layer.

Each layer's graph has the EAGLE head's inputs and outputs (:mod:`qspec.heads.export`), so the runtime runs it
the same way (catch-up over the verified pairs, then chained one-token calls)::

    input_ids, position_ids [batch_size, seq_len], hidden_states [batch_size, seq_len, hidden],
    (batch_index [batch_size, 1]), past_key.0 / past_value.0 [rows, kv_heads, ctx_len, head_dim]
      -> logits [batch_size, 1, vocab]                 the last real token of each row
         hidden_states_out [batch_size, 1, hidden]     the feature the next depth reads
         past_key.0_RetainedState / past_value.0_RetainedState

The block runs through :class:`~qspec.export.wrapper.KVExplicitLM`'s prologue and layer step, as the target's
layers do: its KV is written at ``position_ids``, ``PAD_POSITION`` pads, the mask comes from positions.
"""

from __future__ import annotations

import copy

from torch import nn

from qspec import contract
from qspec.heads.export import _last_real, export_kv_explicit


class _BlockDecoder(nn.Module):
    """What :class:`KVExplicitLM` reads of a Hugging Face model, for one MTP layer's block."""

    def __init__(self, head, layer: int):
        super().__init__()
        self.config = head.config
        self.model = nn.Module()
        self.model.embed_tokens = head.embed_tokens
        self.model.layers = nn.ModuleList([head.mtp_layers[layer].block])
        self.model.rotary_emb = head.rotary_emb


class MTPKVExplicit(nn.Module):
    """``forward(input_ids, position_ids, hidden_states, [batch_index], past_key, past_value)
    -> logits, hidden_states_out, past_key', past_value'`` of MTP layer ``layer``."""

    def __init__(self, head, layer: int, *, continuous_batching: bool):
        super().__init__()
        from qspec.export.wrapper import KVExplicitLM

        # Registered first: the exporter names a shared weight by its last path, and the fused runtime graph finds
        # the block's projections under ``lm.layers.0`` (qspec.heads.ort_graph.EAGLE_LAYER_PREFIX).
        self.mtp = head.mtp_layers[layer]
        self.lm = KVExplicitLM(_BlockDecoder(head, layer), continuous_batching=continuous_batching, speculative=False)
        self.continuous_batching = continuous_batching

    def forward(self, *args):
        input_ids, position_ids, hidden_states, *rest = args
        batch_index = rest[0] if self.continuous_batching else None  # [batch, 1]
        past_key, past_value = rest[-2:]
        embeds, cos, sin, query_pos, anchor, valid = self.lm.prologue(input_ids, position_ids)
        x = self.mtp.fuse(embeds, hidden_states, position_ids)  # [batch, seq, hidden]
        x, keys, values = self.lm.layer_step(
            0, x, cos, sin, query_pos, anchor, valid, batch_index, past_key, past_value
        )
        feature = _last_real(self.mtp.finish(x), valid)  # [batch, 1, hidden]
        return self.mtp.logits(feature).float(), feature, keys, values


def mtp_dims(head, *, continuous_batching: bool) -> dict[str, list]:
    """Dimension names (or sizes) of every input and output of an MTP layer's graph."""
    tokens = [contract.BATCH_SIZE, contract.SEQ_LEN]
    rows = contract.FULL_BATCH_SIZE if continuous_batching else contract.BATCH_SIZE
    kv = [rows, head.config.num_key_value_heads, contract.CTX_LEN, head_dim(head)]
    hidden = head.config.hidden_size
    dims = {
        contract.INPUT_IDS: tokens,
        contract.POSITION_IDS: tokens,
        contract.HIDDEN_STATES: [*tokens, hidden],
    }
    if continuous_batching:
        dims[contract.BATCH_INDEX] = [contract.BATCH_SIZE, 1]
    dims |= {name: kv for name in contract.kv_names(1)}
    dims[contract.LOGITS] = [contract.BATCH_SIZE, 1, head.draft_vocab_size]
    dims[contract.HIDDEN_STATES_OUT] = [contract.BATCH_SIZE, 1, hidden]
    return dims | {contract.retained(name): kv for name in contract.kv_names(1)}


def head_dim(head) -> int:
    return head.mtp_layers[0].block.self_attn.head_dim


def mtp_attention_info(head, layer: int):
    """The :class:`~qspec.package.AttentionInfo` of one MTP layer's block (the fused runtime graph reads it)."""
    from qspec.export.wrapper import attention_info

    return attention_info(_BlockDecoder(head, layer))


def trace_mtp(head, layer: int, *, continuous_batching: bool):
    """MTP layer ``layer`` as an ``onnx_ir`` model, float32 weights in memory."""
    from qspec.export.wrapper import hold_weights_input_major

    dims = mtp_dims(head, continuous_batching=continuous_batching)
    head = copy.deepcopy(head).float().eval()
    hold_weights_input_major(head)  # MatMul(x, W[in, out]): no Transpose to fold, quantizable as is
    wrapper = MTPKVExplicit(head, layer, continuous_batching=continuous_batching).eval()
    kv = (head.config.num_key_value_heads, head_dim(head))
    return export_kv_explicit(wrapper, head.config.hidden_size, kv, dims, continuous_batching)
