"""Draft-head modules and checkpoint layouts on tiny random targets (no export)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from qspec.errors import ModelLoadError  # noqa: E402
from qspec.heads import modules  # noqa: E402


def tiny_target(seed: int = 0, *, tie: bool = True):
    """A tiny random Llama causal LM (GQA 4/2 heads, hidden 64, vocab 320)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("llama", tie=tie)).eval()


def randomize(module: nn.Module, seed: int = 1) -> nn.Module:
    """Non-trivial weights (zero-initialized blocks would be identities)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.requires_grad:
                param.normal_(0, 0.2)
    return module


def sample_inputs(batch: int = 2, steps: int = 6, seed: int = 2):
    torch.manual_seed(seed)
    ids = torch.randint(0, 320, (batch, steps))
    hidden = torch.randn(batch, steps, 64)
    positions = torch.arange(steps).repeat(batch, 1) + 3
    return ids, hidden, positions


def eagle_step_by_step(head: modules.EagleHead, ids, hidden, positions) -> torch.Tensor:
    """The head one token at a time with an explicit KV list: what a KV-cached runtime computes."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = head.layers[0]
    attn = layer.self_attn
    heads, kv_heads, dim = head.config.num_attention_heads, head.config.num_key_value_heads, attn.head_dim
    keys, values, out = [], [], []
    for t in range(ids.shape[1]):
        x = head.fc(torch.cat((head.embed_tokens(ids[:, t : t + 1]), hidden[:, t : t + 1]), dim=-1))
        q = attn.q_proj(x).view(-1, 1, heads, dim).transpose(1, 2)
        k = attn.k_proj(x).view(-1, 1, kv_heads, dim).transpose(1, 2)
        v = attn.v_proj(x).view(-1, 1, kv_heads, dim).transpose(1, 2)
        cos, sin = head.rotary_emb(x, positions[:, t : t + 1])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k), values.append(v)
        k_all = torch.cat(keys, 2).repeat_interleave(heads // kv_heads, 1)
        v_all = torch.cat(values, 2).repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(q @ k_all.transpose(-1, -2) * attn.scaling, dim=-1)
        x = x + attn.o_proj((probs @ v_all).transpose(1, 2).reshape(-1, 1, heads * dim))
        out.append(x + layer.mlp(layer.post_attention_layernorm(x)))
    return torch.cat(out, 1)


def test_eagle_names_are_eagle1s():
    """The head's parameters carry EAGLE-1's names: fc, layers.0 without input_layernorm, no final norm."""
    head = modules.eagle_from_target(tiny_target())
    names = set(head.state_dict())
    assert "fc.weight" in names and "fc.bias" not in names
    assert {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} <= names
    assert {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert "layers.0.post_attention_layernorm.weight" in names
    assert not any("input_layernorm" in n or n.startswith("norm") for n in names)
    assert head.fc.weight.shape == (64, 128)
    trainable = {id(p) for p in head.trainable_parameters()}
    assert id(head.embed_tokens.weight) not in trainable and id(head.lm_head.weight) not in trainable


def test_eagle_teacher_forced_equals_step_by_step():
    """The teacher-forced forward equals a one-token-at-a-time KV-cached computation."""
    head = randomize(modules.eagle_from_target(tiny_target()))
    ids, hidden, positions = sample_inputs()
    with torch.no_grad():
        full = head(ids, hidden, positions)
        steps = eagle_step_by_step(head, ids, hidden, positions)
    assert full.shape == (2, 6, 64)
    torch.testing.assert_close(full, steps, rtol=1e-5, atol=1e-5)
    assert head.logits(full).shape == (2, 6, 320)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_eagle_save_load_round_trip(tmp_path, dtype):
    """save_eagle -> load_eagle gives bit-identical weights (at the saved dtype) and features."""
    target = tiny_target()
    draft_ids = torch.tensor([5, 1, 77, 300, 2, 9])
    head = randomize(modules.eagle_from_target(target, draft_ids=draft_ids, fc_bias=True))
    modules.save_eagle(head, tmp_path, dtype=dtype)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is True and config["draft_vocab_size"] == 6
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored  # the target's
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert torch.equal(stored["d2t"] + torch.arange(6), draft_ids)  # target = draft + d2t[draft]
    assert int(stored["t2d"].sum()) == 6

    loaded = modules.load_eagle(tmp_path, target)
    assert torch.equal(loaded.draft_ids, draft_ids)
    for name, tensor in head.state_dict().items():
        stored_as = tensor if name in modules.TABLES else tensor.to(dtype).float()  # the tables are the target's
        assert torch.equal(loaded.state_dict()[name], stored_as), name
    ids, hidden, positions = sample_inputs()
    if dtype == torch.float32:
        with torch.no_grad():
            assert torch.equal(loaded.logits(loaded(ids, hidden, positions)), head.logits(head(ids, hidden, positions)))


def test_eagle_reads_pytorch_bin_with_its_own_tables(tmp_path):
    """A pytorch_model.bin with its own embed_tokens and lm_head (vLLM's `model.` prefix too) needs no target."""
    head = randomize(modules.eagle_from_target(tiny_target()))
    state = {("model." + k if k != "lm_head.weight" else k): v.clone() for k, v in head.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(head.config.to_json_string())
    loaded = modules.load_eagle(tmp_path)
    assert loaded.own_tables == frozenset(modules.TABLES)
    ids, hidden, positions = sample_inputs()
    with torch.no_grad():
        assert torch.equal(loaded(ids, hidden, positions), head(ids, hidden, positions))
    modules.save_eagle(loaded, tmp_path / "again", dtype=torch.float32)
    assert modules.load_eagle(tmp_path / "again").own_tables == frozenset(modules.TABLES)


def test_eagle_without_tables_or_target_fails(tmp_path):
    """A checkpoint without tables, loaded without its target, is a one-line error."""
    modules.save_eagle(modules.eagle_from_target(tiny_target()), tmp_path)
    with pytest.raises(ModelLoadError, match="load it with the target model"):
        modules.load_eagle(tmp_path)


class _FasterDecodingMedusa(nn.Module):
    """FasterDecoding's `medusa_head` exactly: one ResBlock repeated per head, then a per-head LM head."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int):
        super().__init__()
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*([modules.ResBlock(hidden)] * num_layers), nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads)
        )

    def forward(self, hidden):
        return torch.stack([head(hidden) for head in self.medusa_head], dim=2)


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_medusa_reads_fasterdecoding_layout(tmp_path, suffix):
    """medusa_lm_head.{safetensors,pt} with FasterDecoding's keys loads to the same logits, layers shared."""
    from safetensors.torch import save_file

    reference = randomize(_FasterDecodingMedusa(64, 320, num_heads=3, num_layers=2)).eval()
    state = {k: v.clone() for k, v in reference.medusa_head.state_dict().items()}
    assert "0.0.linear.weight" in state and "0.1.linear.weight" in state and "0.2.weight" in state
    if suffix == "safetensors":
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    head, layout = modules.load_head(tmp_path)
    assert layout == "medusa" and head.per_head_lm_head and head.blocks[0][0] is head.blocks[0][1]
    hidden = torch.randn(2, 4, 64)
    with torch.no_grad():
        assert torch.equal(head(hidden), reference(hidden))  # [B, T, heads, vocab]


def test_medusa_save_load_round_trip_with_token_map(tmp_path):
    """save_medusa -> load_medusa is bit-exact, a reduced vocabulary travels as vLLM's token_map."""
    target = tiny_target()
    head = randomize(modules.medusa_from_target(target, 2, 1, draft_ids=torch.tensor([3, 1, 4, 159])))
    modules.save_medusa(head, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["truncated_vocab_size"] == 4
    loaded = modules.load_medusa(tmp_path)
    assert torch.equal(loaded.draft_ids, head.draft_ids) and loaded.draft_vocab_size == 4
    hidden = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), head(hidden))


def test_medusa_reads_vllm_names_with_distinct_layers(tmp_path):
    """vLLM's blocks.{k}.layers.{l} / lm_heads.{k} names load with distinct (unshared) layers."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    state = {}
    for k in range(2):
        for layer in range(2):
            state[f"blocks.{k}.layers.{layer}.weight"] = torch.randn(64, 64) * 0.2
            state[f"blocks.{k}.layers.{layer}.bias"] = torch.randn(64) * 0.2
        state[f"lm_heads.{k}.weight"] = torch.randn(320, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_heads": 2, "num_hidden_layers": 2, "hidden_size": 64}))
    head, layout = modules.load_head(tmp_path)
    assert layout == "medusa" and head.blocks[0][0] is not head.blocks[0][1]
    hidden = torch.randn(1, 2, 64)
    x = hidden
    for layer in range(2):
        x = x + nn.functional.silu(
            x @ state[f"blocks.1.layers.{layer}.weight"].T + state[f"blocks.1.layers.{layer}.bias"]
        )
    with torch.no_grad():
        torch.testing.assert_close(head(hidden)[:, :, 1], x @ state["lm_heads.1.weight"].T)


def test_turbo_layers_share_one_module_as_qefficient(tmp_path):
    """Turbo's `[ResBlock(h)] * num_layers` repeats ONE module: the file's last layer wins for every layer."""
    from safetensors.torch import save_file

    target = tiny_target()
    projections = nn.ModuleList(nn.Sequential(*([modules.ResBlock(64)] * 3)) for _ in range(2))  # QEfficient's
    torch.manual_seed(4)
    state = {
        f"projections.{k}.{layer}.linear.{w}": torch.randn(64, 64) * 0.2 if w == "weight" else torch.randn(64) * 0.2
        for k in range(2)
        for layer in range(3)
        for w in ("weight", "bias")
    }  # distinct values per layer in the file
    save_file(state, str(tmp_path / "speculator.safetensors"))
    (tmp_path / "speculator_config.json").write_text(json.dumps({"turbo_num_heads": 2, "turbo_num_layers": 3}))
    projections.load_state_dict({k.removeprefix("projections."): v for k, v in state.items()}, strict=True)

    head, layout = modules.load_head(tmp_path, target)
    assert layout == "turbo" and head.blocks[1][0] is head.blocks[1][2]
    assert torch.equal(head.blocks[0][0].linear.weight, state["projections.0.2.linear.weight"])  # last wins
    hidden = torch.randn(2, 1, 64)
    with torch.no_grad():
        want = torch.stack([target.lm_head(p(hidden)) for p in projections], dim=2)
        assert torch.equal(head(hidden), want)
    modules.save_turbo(head, tmp_path / "again", dtype=torch.float32)
    again = modules.load_turbo(tmp_path / "again", target)
    with torch.no_grad():
        assert torch.equal(again(hidden), want)


def test_detect_layout_names_what_it_expects(tmp_path):
    """A folder without a head is an error that lists the layouts."""
    with pytest.raises(ModelLoadError, match="EAGLE-1 config.json"):
        modules.detect_layout(tmp_path)
