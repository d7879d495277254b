"""The names of the qspec ONNX contract, in one place.

The exporter writes them, the specialization builder uses the axis names as keys, and the runtime
binds them. The vendor compiler pairs every ``X`` input with the ``X_RetainedState`` output of the
same name (``-retained-state``), so none of these strings is cosmetic.
"""

from __future__ import annotations

# Graph inputs.
INPUT_IDS = "input_ids"  # int64 [batch_size, seq_len]
POSITION_IDS = "position_ids"  # int64 [batch_size, seq_len]; PAD_POSITION marks padding
BATCH_INDEX = "batch_index"  # int64 [batch_size, 1]; continuous batching only
NUM_LOGITS_TO_KEEP = "num_logits_to_keep"  # int64 [num_logits_to_keep, 1]; only its shape matters
COMP_CTX_LENGTHS = "comp_ctx_lengths"  # int64 [comp_ctx_lengths]; its length bounds the slots attention reads
# Tree verification on the vendor graph (ExportOptions.tree_inputs; qspec.runtime.layout): siblings share a
# position, so the KV of a call goes to explicit slots, attention follows an ancestor mask, and an accepted
# sibling's KV is copied to its depth's slot by the next call. Dims are the specializations' own symbols.
WRITE_SLOTS = "write_slots"  # int64 [batch_size, seq_len]: the KV slot of each live token (a chain: its position)
TREE_MASK = "tree_mask"  # bool [batch_size, seq_len, seq_len]: [b, s, t] token s may see token t of its row
KV_MOVES = "kv_moves"  # int64 [batch_size, seq_len, 2]: (from, to) KV slot copies of the row, before the call
TREE_INPUTS = (WRITE_SLOTS, TREE_MASK, KV_MOVES)

# Graph output.
LOGITS = "logits"  # float [batch_size, num_logits_to_keep or 1, vocab]

# Hidden-state drafting (EAGLE, Medusa). A target compiled for a draft head has one more output:
HIDDEN_STATES = "hidden_states"  # float [batch_size, seq_len, hidden]: the final-norm state the LM head reads
# A draft head's graph takes HIDDEN_STATES as an input (EAGLE: with input_ids, position_ids and its own KV;
# Medusa: [batch_size, 1, hidden] alone) and returns LOGITS over its draft vocabulary
# ([batch_size, 1, draft_vocab] for EAGLE, [batch_size, num_heads, draft_vocab] for Medusa); an EAGLE head
# also returns the feature it predicts, which the next chained call takes as its HIDDEN_STATES.
HIDDEN_STATES_OUT = "hidden_states_out"  # float [batch_size, 1, hidden]

RETAINED_STATE_SUFFIX = "_RetainedState"

# Symbolic dimension names: exactly the keys of a specialization.
BATCH_SIZE = "batch_size"
SEQ_LEN = "seq_len"
CTX_LEN = "ctx_len"
FULL_BATCH_SIZE = "full_batch_size"
# NUM_LOGITS_TO_KEEP and COMP_CTX_LENGTHS are both input names and dimension names.
SPECIALIZATION_KEYS = (BATCH_SIZE, SEQ_LEN, CTX_LEN, FULL_BATCH_SIZE, NUM_LOGITS_TO_KEEP, COMP_CTX_LENGTHS)

# Position id of a padding token: it writes nothing a live token can see and gets no logits.
PAD_POSITION = -1


def past_key(layer: int) -> str:
    """Input name of layer ``layer``'s key buffer: ``past_key.{i}``."""
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    """Input name of layer ``layer``'s value buffer: ``past_value.{i}``."""
    return f"past_value.{layer}"


def latent_kv(layer: int) -> str:
    """Input name of layer ``layer``'s latent buffer in a multi-head latent attention cache (DeepSeek-V3, as
    QEfficient's ``cache_compressed`` names it): ``compressed_kv.{i}`` ``[rows, 1, ctx_len, kv_lora_rank]``."""
    return f"compressed_kv.{layer}"


def rope_key(layer: int) -> str:
    """Input name of layer ``layer``'s rotated shared key buffer beside :func:`latent_kv`: ``k_pe.{i}``
    ``[rows, 1, ctx_len, qk_rope_head_dim]``."""
    return f"k_pe.{layer}"


def retained(name: str) -> str:
    """Output name that carries the updated buffer of input ``name``."""
    return name + RETAINED_STATE_SUFFIX


def kv_names(num_layers: int, *, latent: bool = False) -> list[str]:
    """All KV input names in graph order: ``past_key.0, past_value.0, past_key.1, ...``; with ``latent`` (a
    multi-head latent attention cache) ``compressed_kv.0, k_pe.0, compressed_kv.1, ...``."""
    pair = (latent_kv, rope_key) if latent else (past_key, past_value)
    return [name(i) for i in range(num_layers) for name in pair]


def input_names(
    num_layers: int,
    *,
    continuous_batching: bool,
    speculative: bool,
    comp_ctx_lengths: bool = False,
    tree_inputs: bool = False,
    latent: bool = False,
) -> list[str]:
    """Graph input names, in order, for a graph with these options."""
    names = [INPUT_IDS, POSITION_IDS]
    if continuous_batching:
        names.append(BATCH_INDEX)
    if speculative:
        names.append(NUM_LOGITS_TO_KEEP)
    if comp_ctx_lengths:
        names.append(COMP_CTX_LENGTHS)
    if tree_inputs:
        names.extend(TREE_INPUTS)
    return names + kv_names(num_layers, latent=latent)


def output_names(num_layers: int, *, hidden_states: bool = False, latent: bool = False) -> list[str]:
    """Graph output names, in order: logits, [hidden_states], then every KV buffer's retained state."""
    kv = kv_names(num_layers, latent=latent)
    return [LOGITS] + ([HIDDEN_STATES] if hidden_states else []) + [retained(name) for name in kv]
