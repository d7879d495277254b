"""EAGLE-3 training: the training-time test's masks, the loss, the saved layout, resumable phases, and that
MT-bench never enters the training data. Tiny random models only."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qspec.heads import eagle3_model, eagle3_train  # noqa: E402
from qspec.heads.eagle3_model import Eagle3Head, ttt_mask  # noqa: E402

CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 50,
}


def tiny_head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(CONFIG, torch.randn(50, 32), torch.arange(0, 50, 2))  # draft vocabulary: even ids
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    return head.eval()


def test_ttt_mask_is_causal_on_the_prefix_and_diagonal_on_the_chain():
    """Step 2 of a 3-row unroll: the step-0 keys of rows <= t, and row t's own keys of steps 1 and 2."""
    expected = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ttt_mask(3, 2), expected)
    assert torch.equal(ttt_mask(3, 0), torch.ones(3, 3, dtype=torch.bool).tril())


def chained_decode(head: Eagle3Head, ids, taps, t: int, steps: int) -> list[torch.Tensor]:
    """What a runtime does: prefill rows 0..t causally into a KV cache, then draft ``steps - 1`` more tokens
    one at a time, each appending its key and value and seeing the whole cache. Logits at row t per step."""
    cache: list = []
    prefix_ids, prefix_taps = ids[:, : t + 1], taps[:, : t + 1]
    feature, logits = head.step(
        prefix_ids, head.project(prefix_taps), torch.arange(t + 1)[None], cache, ttt_mask(t + 1, 0)
    )
    out, feature = [logits[0, -1]], feature[:, -1:]
    for j in range(1, steps):
        keys = sum(c[0].shape[2] for c in cache) + 1
        feature, logits = head.step(
            ids[:, t + j : t + j + 1], feature, torch.tensor([[t + j]]), cache, torch.ones(1, keys, dtype=torch.bool)
        )
        out.append(logits[0, -1])
    return out


def test_unroll_equals_a_chained_decode_with_a_kv_cache():
    """Every row of the training-time test drafts what a prefix-then-chain decode drafts (<= 1e-5)."""
    head = tiny_head()
    ids, taps = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, 3, 32)
    unrolled = head.unroll(ids, taps, 3)
    for t in range(0, 6):
        for j, logits in enumerate(chained_decode(head, ids, taps, t, 3)):
            assert torch.allclose(unrolled[j][0, t], logits, atol=1e-5), (t, j)


def test_unroll_does_not_see_the_future():
    """Changing the taps after row t, the tokens after its chain, or other rows' chains leaves row t's
    drafts unchanged at every step; changing its own chain token changes its later steps."""
    head = tiny_head()
    ids, taps = torch.randint(0, 50, (1, 10)), torch.randn(1, 10, 3, 32)
    t, steps = 3, 3
    base = head.unroll(ids, taps, steps)
    future_ids, future_taps = ids.clone(), taps.clone()
    future_ids[:, t + steps :] = (future_ids[:, t + steps :] + 7) % 50  # tokens past row t's chain
    future_taps[:, t + 1 :] += 1.0  # true features of later rows: the chain must not read them
    moved = head.unroll(future_ids, future_taps, steps)
    for j in range(steps):
        assert torch.allclose(base[j][0, t], moved[j][0, t], atol=1e-6), f"step {j} saw the future"
    own = ids.clone()
    own[:, t + 1] = (own[:, t + 1] + 1) % 50  # row t's step-1 token: its own chain
    changed = head.unroll(own, taps, steps)
    assert not torch.allclose(base[1][0, t], changed[1][0, t])


def test_step_labels_and_weights():
    """Step j of row t learns the greedy label after position t + 1 + j, answer tokens only, 0.8^j."""
    t2d = np.arange(10)
    labels = np.array([5, 6, 7, 8, 9])  # greedy label after each position
    out = eagle3_train.step_labels(labels, answer=3, steps=2, t2d=t2d)
    # label positions p in [answer - 1, n - 2] = [2, 3]: step 0 rows 1, 2; step 1 rows 0, 1
    assert out.tolist() == [[-100, 7, 8, -100, -100], [7, 8, -100, -100, -100]]
    assert eagle3_train.step_weights(3) == [1.0, 0.8, 0.8**2]


def test_unroll_loss_is_the_weighted_sum_of_step_cross_entropies():
    head = tiny_head()
    ids, taps = torch.randint(0, 50, (2, 6)), torch.randn(2, 6, 3, 32)
    labels = torch.randint(0, 25, (3, 2, 6))
    labels[:, :, -2:] = -100
    loss, parts = eagle3_train.unroll_loss(head, (ids, taps, labels), 3)
    logits = head.unroll(ids, taps, 3)
    manual = [
        torch.nn.functional.cross_entropy(lg.flatten(0, 1), labels[j].flatten(), ignore_index=-100)
        for j, lg in enumerate(logits)
    ]
    assert parts == pytest.approx([m.item() for m in manual], rel=1e-5)
    assert loss.item() == pytest.approx(sum(0.8**j * m.item() for j, m in enumerate(manual)), rel=1e-5)


def test_saved_head_has_the_vllm_eagle3_names_and_shapes(tmp_path):
    """fc [H, 3H], midlayer q/k/v over 2H, own lm_head over the draft vocabulary, d2t/t2d; no embedding;
    a config vLLM and SpecForge read, without machine paths."""
    from safetensors import safe_open

    head = tiny_head()
    head.config |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": 25,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
    }
    eagle3_model.save_head(head, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert shapes == {
        "fc.weight": (32, 96),
        "midlayer.input_layernorm.weight": (32,),
        "midlayer.hidden_norm.weight": (32,),
        "midlayer.self_attn.q_proj.weight": (32, 64),
        "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64),
        "midlayer.self_attn.o_proj.weight": (32, 32),
        "midlayer.post_attention_layernorm.weight": (32,),
        "midlayer.mlp.gate_proj.weight": (48, 32),
        "midlayer.mlp.up_proj.weight": (48, 32),
        "midlayer.mlp.down_proj.weight": (32, 48),
        "norm.weight": (32,),
        "lm_head.weight": (25, 32),
        "d2t": (25,),
        "t2d": (50,),
    }
    assert dtypes["fc.weight"] == torch.float16 and dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool
    back = eagle3_model.load_trained(tmp_path, head.embed_tokens.weight)
    assert torch.equal(back.draft_ids, torch.arange(0, 50, 2))  # target id = draft id + d2t[draft id]
    text = (tmp_path / "config.json").read_text()
    assert json.loads(text)["architectures"] == ["LlamaForCausalLMEagle3"] and "/" not in text


def test_head_config_from_a_target(tiny_model):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model("llama", layers=6))
    head = eagle3_model.head_from_target(target, torch.tensor([1, 2, 5]), (2, 3, 3))
    config = head.config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 3
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[[1, 2, 5]])


def test_lens_init_drafts_the_targets_logit_lens_at_the_last_tap(tiny_model):
    """Untrained, a lens-initialised head's first step is lm_head(norm(tap 2)) over the draft vocabulary."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model("llama", layers=6)).eval()
    draft_ids = torch.tensor([3, 7, 11, 40, 41])
    head = eagle3_model.head_from_target(target, draft_ids, (1, 2, 4), init="lens")
    ids = torch.randint(0, 300, (1, 7))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        taps = torch.stack([out.hidden_states[t] for t in (1, 2, 4)], 2)
        logits = head.unroll(ids, taps, 1)[0]
        lens = target.lm_head(target.model.norm(out.hidden_states[4]))[..., draft_ids]
    assert torch.allclose(logits, lens, atol=1e-4)


def test_saved_head_loads_in_qspecs_eagle3_kind_and_drafts_the_same(tiny_model, tmp_path):
    """qspec's EAGLE-3 loader (the runtime's) reads a trained head and computes the same first step (<= 1e-4)."""
    from transformers import AutoModelForCausalLM

    from qspec.heads.eagle3 import load_eagle3

    target = AutoModelForCausalLM.from_pretrained(tiny_model("llama", layers=6)).eval()
    head = eagle3_model.head_from_target(target, torch.tensor([3, 7, 11, 40, 41]), (1, 2, 4), init="random")
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    eagle3_model.save_head(head, tmp_path, dtype=torch.float32)
    loaded = load_eagle3(tmp_path, target)
    assert loaded.layer_ids(6) == (1, 2, 4)
    ids, taps = torch.randint(0, 300, (1, 6)), torch.randn(1, 6, 3, 64)
    with torch.no_grad():
        mine = head.unroll(ids, taps, 1)[0]
        feature = loaded.combine([taps[:, :, i] for i in range(3)])
        theirs = loaded.logits(loaded(ids, feature, torch.arange(6)[None]))
    assert torch.allclose(mine, theirs, atol=1e-4)
