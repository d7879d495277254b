"""A KV-explicit forward pass around a Hugging Face decoder, traced to the qspec ONNX contract.

The wrapper reuses the model's own modules (embedding, projections, norms, MLP, LM head) and replaces
only what the contract changes: the KV cache is a static ``ctx_len`` buffer per layer, passed in and
returned (``..._RetainedState``), the KV of the call's tokens is written **at ``position_ids``**, and
the attention mask comes from positions (query at position ``p`` sees slot ``j`` iff ``j <= p``).

The KV write and read are QEfficient's ``CtxScatter`` / ``CtxGather`` (``...CB`` with ``batch_index``)
ONNX functions (:mod:`qspec.export.ctx_ops`). Padding tokens (``position_ids == PAD_POSITION``) write
back the value a slot already holds, into a slot that no live token of the call writes: nothing
visible changes and every index stays in ``[0, ctx_len)``. Attention reads slots ``[0, n)`` (``n`` the
buffer's or the compute context's length); a slot past a row's last position is read at slot 0, as
QEfficient reads it, and masked. Live tokens of one row must sit at consecutive positions (they
always do: a prefill chunk, or ``[last_token, d_1..d_n]``).

What differs between architectures lives in a small :class:`~qspec.export.adapters.Adapter`; adding a family
is adding one.
"""

from __future__ import annotations

import torch
from torch import nn

from qspec.export.adapters import ADAPTERS, Adapter, Scales, adapter_for, attention_info, supported_families
from qspec.export.ctx_ops import ctx_gather, ctx_gather_cb, ctx_scatter, ctx_scatter_cb
from qspec.export.mla import expanded_qkv, is_latent, latent_attention, latent_states
from qspec.export.moe import is_moe, static_moe

__all__ = ["ADAPTERS", "Adapter", "KVExplicitLM", "Scales", "adapter_for", "attention_info", "supported_families"]


class InputMajorLinear(nn.Module):
    """``nn.Linear`` with its weight held ``[in, out]``: it traces to ``MatMul(x, W)`` with no Transpose.

    The weight is a transposed *view* of the linear's own (no copy); the graph stores it in the
    layout its MatMul reads, as the vendor compiler and ONNX Runtime want it, so neither folds
    a transpose of every weight (ONNX Runtime did so at every session load, and its optimized
    graph held a second copy of the weights). Same computation, same parameter name.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().t(), requires_grad=False)  # [in, out]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


def hold_weights_input_major(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` whose weight no other module shares (a tied LM head keeps
    its embedding's table) for an :class:`InputMajorLinear`; returns how many were swapped."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for tensor in module.parameters(recurse=False):
            owners[id(tensor)] = owners.get(id(tensor), 0) + 1
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and owners[id(child.weight)] == 1
    ]
    for parent, name, child in swaps:
        setattr(parent, name, InputMajorLinear(child))
    return len(swaps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``rotary_dim`` (``cos``'s last size) features of each head; the rest pass (Phi-3's
    partial rotary)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


class KVExplicitLM(nn.Module):
    """``forward(input_ids, position_ids, [batch_index], [num_logits_to_keep], *kv)``
    ``-> logits, [hidden_states], *kv'``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        continuous_batching: bool,
        speculative: bool,
        comp_ctx_lengths: bool = False,
        hidden_states: bool = False,
        tree_inputs: bool = False,
        latent_cache: bool = False,
    ):
        super().__init__()
        self.tree_inputs = tree_inputs  # `write_slots`, `tree_mask`, `kv_moves` inputs after the others
        self.hidden_states = hidden_states  # also return the final-norm hidden state of every position
        self.model = model
        self.config = model.config
        self.adapter = adapter_for(model.config)
        self.continuous_batching = continuous_batching
        self.speculative = speculative
        self.comp_ctx_lengths = comp_ctx_lengths  # a `comp_ctx_lengths` input bounds the slots attention reads
        decoder = model.model
        self.layers = decoder.layers
        self.num_layers = len(decoder.layers)
        self.scales = self.adapter.scales(model.config)
        # Distinct RoPE tables (one, or Gemma 3's local and global); layer i rotates with table rope_of[i].
        ropes = [self.adapter.rope(decoder.rotary_emb, model.config, i) for i in range(len(decoder.layers))]
        tables = list(dict.fromkeys((tuple(f.detach().float().tolist()), scale) for f, scale in ropes))
        self.rope_of = [tables.index((tuple(f.detach().float().tolist()), scale)) for f, scale in ropes]
        self.register_buffer("inv_freq", torch.tensor([t[0] for t in tables]), persistent=False)  # [tables, d/2]
        self.register_buffer("rope_scales", torch.tensor([[t[1]] for t in tables]), persistent=False)
        attn = decoder.layers[0].self_attn
        # DeepSeek's MLA (qspec.export.mla): with latent_cache the normed latent and the rotated key are cached
        # (one entry for all heads), else every head's expanded key and value
        self.expanded = is_latent(attn) and not latent_cache
        self.latent = is_latent(attn) and latent_cache
        self.head_dim = attn.qk_nope_head_dim + attn.qk_rope_head_dim if self.expanded else getattr(attn, "head_dim", 0)
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = 1 if self.latent else self.num_heads if self.expanded else model.config.num_key_value_heads
        self.windows = [self.adapter.window(model.config, i, layer.self_attn) for i, layer in enumerate(decoder.layers)]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor):
        rest = list(rest)
        batch_index = rest.pop(0) if self.continuous_batching else None  # [batch, 1]
        num_logits = rest.pop(0) if self.speculative else None  # [num_logits_to_keep, 1]
        ccl = rest.pop(0) if self.comp_ctx_lengths else None  # [comp_ctx_lengths]
        tree = tuple(rest.pop(0) for _ in range(3)) if self.tree_inputs else None  # write_slots, tree_mask, kv_moves
        assert len(rest) == 2 * self.num_layers, f"expected {2 * self.num_layers} KV inputs, got {len(rest)}"
        hidden, *shared = self.prologue(input_ids, position_ids)
        new_kv = []
        for i in range(self.num_layers):
            kv = (rest[2 * i], rest[2 * i + 1])
            hidden, keys, values = self.layer_step(i, hidden, *shared, batch_index, *kv, ccl, tree=tree)
            new_kv.extend((keys, values))
        out = self.epilogue(hidden, shared[-1], num_logits)
        return (*(out if self.hidden_states else (out,)), *new_kv)

    # The three pieces below are the whole computation. `forward` chains them; the exporter traces
    # each piece once (one layer per distinct layer signature) and chains the traced graphs.

    def prologue(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Embeddings and what every layer shares: ``hidden, cos, sin, query_pos, anchor, valid``."""
        seq = input_ids.shape[1]
        valid = position_ids >= 0  # [batch, seq]
        steps = torch.arange(seq, dtype=torch.int64)
        query_pos = torch.where(valid, position_ids, torch.zeros_like(position_ids))
        cos, sin = self._rope_tables(query_pos)  # [batch, 1, seq, head_dim]
        hidden = self.model.model.embed_tokens(input_ids)  # [batch, seq, hidden]
        if self.scales.embedding is not None:
            hidden = hidden * self.scales.embedding
        return hidden, cos, sin, query_pos, _write_anchor(position_ids, valid, steps), valid

    def layer_step(
        self,
        i: int,
        hidden,
        cos,
        sin,
        query_pos,
        anchor,
        valid,
        batch_index,
        past_key,
        past_value,
        ccl=None,
        attn_input=None,
        tree=None,
    ):
        """Decoder layer ``i`` over the static KV buffers; returns ``hidden, keys', values'``.

        ``ccl`` (compute context length): attention reads only slots ``[0, len(ccl))``; the caller
        keeps every live position below it. The write still goes to the whole ``ctx_len`` buffer.
        ``attn_input``: what q/k/v read instead of ``input_layernorm(hidden)`` (an EAGLE-3 head's 2H input).
        ``tree``: ``(write_slots, tree_mask, kv_moves)`` (:func:`_tree_slots`): the KV slots come from the
        host, attention follows the ancestor mask, and the row's moved slots are copied first.
        """
        layer = self.layers[i]
        key_pos = torch.arange(past_key.shape[2], dtype=torch.int64)  # [ctx_len]
        steps = torch.arange(hidden.shape[1], dtype=torch.int64)
        ctx_len = key_pos[-1:] + 1  # a tensor: the exporter cannot take a remainder by a symbolic int
        slots = torch.where(valid, query_pos, torch.remainder(anchor + steps, ctx_len))  # [batch, seq]
        read = ccl.shape[0] if ccl is not None else past_key.shape[2]
        kv = (past_key, past_value)
        if tree is None:
            mask = _visible(
                query_pos, key_pos[:read] if ccl is not None else key_pos, self.windows[i]
            )  # [b, 1, 1, seq, read]
            reads = _read_slots(query_pos, read)
        else:
            write_slots, tree_mask, kv_moves = tree
            slots = torch.where(valid, write_slots, slots)
            kv = (_move(past_key, kv_moves, batch_index), _move(past_value, kv_moves, batch_index))
            mask = _tree_visible(query_pos, slots, tree_mask, valid, key_pos, read, self.windows[i])
            reads = _read_slots(torch.where(valid, slots, torch.zeros_like(slots)), read)
        cos, sin = self._layer_rope(i, cos, sin)
        norms = self.adapter.norms
        if attn_input is not None:
            x = attn_input
        else:
            x = hidden if norms == "post" else layer.input_layernorm(hidden)
        attn_out, (keys, values) = self._attention(layer, x, cos, sin, mask, kv, slots, valid, batch_index, reads)
        if norms != "pre":
            attn_out = layer.post_attention_layernorm(attn_out)
        hidden = hidden + self._residual(attn_out)
        mlp = layer.mlp if not is_moe(layer.mlp) else lambda x: static_moe(layer.mlp, x, self.adapter.router)
        if norms == "pre":
            mlp_out = mlp(layer.post_attention_layernorm(hidden))
        elif norms == "post":
            mlp_out = layer.post_feedforward_layernorm(mlp(hidden))
        else:
            mlp_out = layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(hidden)))
        return hidden + self._residual(mlp_out), keys, values

    def _residual(self, x):
        return x if self.scales.residual is None else x * self.scales.residual

    def _layer_rope(self, i: int, cos, sin):
        """Layer ``i``'s RoPE rows out of the prologue's tables, side by side on the last axis."""
        if self.inv_freq.shape[0] == 1:
            return cos, sin
        width = 2 * self.inv_freq.shape[1]
        at = self.rope_of[i] * width
        return cos[..., at : at + width], sin[..., at : at + width]

    def epilogue(self, hidden, valid, num_logits_to_keep):
        """Logits of the last ``num_logits_to_keep`` real tokens of each (right-padded) row, and with
        :attr:`hidden_states` the final-norm hidden state of every position (what a draft head reads).

        The hidden states come from a norm of their own, so the logits' computation is the one without them.
        """
        batch, seq, width = hidden.shape
        num_logits = num_logits_to_keep.shape[0] if num_logits_to_keep is not None else 1
        steps = torch.arange(seq, dtype=torch.int64)
        last = (valid.to(torch.int64) * steps).amax(dim=1, keepdim=True)  # [batch, 1]
        keep = (last - (num_logits - 1) + torch.arange(num_logits, dtype=torch.int64)).clamp(min=0)
        picked = hidden.gather(1, keep.unsqueeze(-1).expand(batch, num_logits, width))
        logits = self.model.lm_head(self.model.model.norm(picked)).float()  # [batch, keep, vocab]
        if self.scales.logits_divisor is not None:
            logits = logits / self.scales.logits_divisor
        if self.scales.final_softcap is not None:
            logits = _softcap(logits, self.scales.final_softcap)
        if not self.hidden_states:
            return logits
        return logits, self.model.model.norm(hidden).float()  # [batch, seq, hidden]

    def layer_signature(self, i: int) -> tuple:
        """Layers with equal signatures trace to the same graph (only their weights differ)."""
        return (self.windows[i], self.rope_of[i], is_moe(self.layers[i].mlp))

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[batch, 1, seq, tables * rotary_dim]``: every RoPE table, side by side."""
        freqs = positions[..., None, None].float() * self.inv_freq  # [batch, seq, tables, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [batch, seq, tables, rotary_dim]
        cos = (emb.cos() * self.rope_scales).flatten(-2).unsqueeze(1)
        sin = (emb.sin() * self.rope_scales).flatten(-2).unsqueeze(1)
        return cos, sin

    def _attention(self, layer, x, cos, sin, mask, kv, slots, valid, batch_index, reads):
        attn = layer.self_attn
        batch, seq, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        interleave = bool(getattr(self.config, "rope_interleave", False))
        if self.expanded:
            q, k, v = expanded_qkv(attn, x, cos, sin, interleave=interleave)
        elif self.latent:
            q_nope, q_rot, k, v = latent_states(attn, x, cos, sin, interleave=interleave)
        else:
            q, k, v = self._head_states(attn, x, cos, sin)  # [batch, heads or kv_heads, seq, dim]
        k, v = k.to(kv[0].dtype), v.to(kv[1].dtype)

        new_keys, new_values = _write(kv[0], k, slots, valid, batch_index), _write(kv[1], v, slots, valid, batch_index)
        keys, values = _read(new_keys, reads, batch_index), _read(new_values, reads, batch_index)  # [b, kv, read, dim]
        if self.latent:  # keys: the latents, values: the rotated shared keys
            out = latent_attention(attn, q_nope, q_rot, keys.to(q_nope.dtype), values.to(q_nope.dtype), mask[:, 0])
            return out, (new_keys, new_values)

        groups = heads // kv_heads
        q = q.reshape(batch, kv_heads, groups, seq, dim)
        scores = torch.matmul(q, keys.unsqueeze(2).transpose(-1, -2).to(q.dtype)) * attn.scaling
        if self.scales.attention_softcap is not None:
            scores = _softcap(scores, self.scales.attention_softcap)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # [batch, kv, groups, seq, ctx]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, values.unsqueeze(2).to(q.dtype))  # [batch, kv, groups, seq, dim]
        width = values.shape[-1]
        out = out.reshape(batch, heads, seq, width).transpose(1, 2).reshape(batch, seq, heads * width)
        return attn.o_proj(out), (new_keys, new_values)

    def _head_states(self, attn, x, cos, sin):
        """q ``[batch, heads, seq, dim]``, k and v ``[batch, kv_heads, seq, dim]``, q and k normed and rotated."""
        batch, seq, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._projections(attn, x)
        if self.adapter.qk_norm_full:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv_heads, dim), v.view(batch, seq, kv_heads, dim)
        if self.adapter.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def _projections(self, attn, x):
        """q, k, v ``[batch, seq, heads * head_dim]`` from three projections or one fused ``qkv_proj``."""
        if not self.adapter.fused_qkv:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return attn.qkv_proj(x).split([width, kv_width, kv_width], dim=-1)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's soft-capping)."""
    return torch.tanh(x / cap) * cap


def _write_anchor(position_ids, valid, steps):
    """Virtual position of step 0 of each row, from which padding steps take their slots.

    Live tokens of a row sit at consecutive positions ``p0 .. p0 + n - 1`` from step ``s0``; padding at
    step ``s`` takes the virtual position ``p0 - s0 + s`` modulo ``ctx_len``, so the anchor is
    ``p0 - s0`` (0 for a row with no live token). Those ``seq <= ctx_len`` virtual positions are
    distinct, so padding never lands on a slot a live token writes. Example, ctx 8, positions
    ``[6, 7, -1]`` -> anchor 6, slots ``[6, 7, 0]``; positions ``[-1, -1]`` -> anchor 0, slots ``[0, 1]``.
    """
    offset = torch.where(valid, position_ids - steps, torch.full_like(position_ids, -(2**62)))
    anchor = offset.amax(dim=1, keepdim=True)  # [batch, 1]
    return torch.where(anchor < 0, torch.zeros_like(anchor), anchor)


def _write(buffer, new, slots, valid, batch_index):
    """``buffer`` with ``new`` [batch, kv, seq, dim] written at ``slots`` (``CtxScatter``, ``CtxScatterCB``).

    A padding token writes the value its slot holds (read with ``CtxGather``): its write changes nothing.
    """
    at = slots[:, None, :]  # [batch, 1, seq]
    if batch_index is None:
        value = torch.where(valid[:, None, :, None], new, ctx_gather(buffer, at, slots.shape[1]))
        return ctx_scatter(buffer, slots, value)
    value = torch.where(valid[:, None, :, None], new, ctx_gather_cb(buffer, batch_index, at, slots.shape[1]))
    return ctx_scatter_cb(buffer, batch_index, slots, value)


def _read_slots(query_pos, read):
    """``[batch, 1, read]``: the slots attention reads, ``j`` up to the row's last position, then 0 (QEfficient's
    invalid index under ``torch.export``; the mask hides those slots). Example, read 4, positions ``[1, 2]``
    -> ``[0, 1, 2, 0]``."""
    slots = torch.arange(read, dtype=torch.int64)[None, None, :]
    last = query_pos.amax(dim=1, keepdim=True)[:, :, None]  # [batch, 1, 1]
    return torch.where(slots > last, torch.zeros_like(slots), slots)


def _read(buffer, reads, batch_index):
    """The slots ``reads`` [batch, 1, n] of each row's KV (``CtxGather``, ``CtxGatherCB``): [batch, kv, n, dim]."""
    if batch_index is None:
        return ctx_gather(buffer, reads, reads.shape[2])
    return ctx_gather_cb(buffer, batch_index, reads, reads.shape[2])


def _move(buffer, moves, batch_index):
    """``buffer`` with slot ``moves[b, j, 0]`` of each call row's KV copied to slot ``moves[b, j, 1]`` (an accepted
    tree draft's KV to its depth's slot, :meth:`qspec.runtime.layout.VerifyLayout.moves`); a row without moves
    repeats one copy of a slot onto itself, a no-op. ``CtxGather`` then ``CtxScatter``, as the write."""
    src, dst = moves[:, :, 0], moves[:, :, 1]  # [batch, m]
    if batch_index is None:
        return ctx_scatter(buffer, dst, ctx_gather(buffer, src[:, None, :], src.shape[1]))
    return ctx_scatter_cb(buffer, batch_index, dst, ctx_gather_cb(buffer, batch_index, src[:, None, :], src.shape[1]))


def _tree_visible(query_pos, slots, tree_mask, valid, key_pos, read: int, window: int | None):
    """``mask[b, 0, 0, s, j]`` of a call whose live tokens are written at ``slots`` ``[batch, seq]``: query ``s`` sees
    the row's slots before its first written one (the cache) and the slot of every live token ``t`` with
    ``tree_mask[b, s, t]``, all within ``window`` slots of its position (a sliding-window layer). The mask is
    placed at the tokens' slots by ``CtxScatter``, the queries as its heads. On a chain (``slots`` its positions,
    ``tree_mask`` lower-triangular) this is :func:`_visible`'s mask. Example, slots ``[10, 11, 12, 13]`` of a tree
    ``[last, a, b, c]`` (``c`` beside ``a``): ``c`` sees slots ``0..9``, 10 and 13."""
    batch, seq = slots.shape
    far = torch.full_like(slots, 2**62)
    start = torch.where(valid, slots, far).amin(dim=1, keepdim=True)  # [batch, 1]; a row of padding: far
    history = key_pos[None, None, :read] < start[:, :, None]  # [batch, 1, read]
    allowed = (tree_mask & valid[:, None, :]).to(torch.float32)  # [batch, query, token]
    grid = torch.zeros(batch, seq, key_pos.shape[0], 1, dtype=torch.float32)
    placed = ctx_scatter(grid, slots, allowed.unsqueeze(-1))[..., :read, 0]  # [batch, query, read]
    mask = history | (placed > 0.5)
    if window is not None:  # by slot: a chain's slots are its positions
        mask = mask & (key_pos[None, None, :read] > query_pos[:, :, None] - window)
    return mask[:, None, None]


def _visible(query_pos, key_pos, window: int | None):
    """``mask[b, 0, 0, s, j]``: query at ``query_pos[b, s]`` may attend slot ``j``."""
    q = query_pos[:, None, None, :, None]
    mask = key_pos <= q
    if window is not None:
        mask = mask & (key_pos > q - window)
    return mask
