"""EAGLE-3 heads as vLLM / SpecForge and `speculators` write them: detection, loading, and the head graph against a
reference forward written from vLLM's ``llama_eagle3.py`` (random weights, the chained step included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qspec.errors import ModelLoadError  # noqa: E402
from qspec.heads.eagle3 import load_eagle3  # noqa: E402
from qspec.heads.kinds import KINDS, detect_kind  # noqa: E402
from tests.test_heads_modules import tiny_target  # noqa: E402

ort = pytest.importorskip("onnxruntime")
HIDDEN, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 320


def write_eagle3_head(
    folder: Path,
    target_config,
    *,
    layout: str = "vllm",
    draft_ids: list[int] | None = None,
    layer_ids: list[int] | None = None,
    norm_before_residual: bool = False,
    own_embed: bool = False,
    seed: int = 3,
) -> Path:
    """A random EAGLE-3 head under the names vLLM's loader reads (``midlayer.*``) or `speculators` writes
    (``layers.0.*``, ``speculators_model_type``), fp16 safetensors and config.json as those tools write them."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    dim = HIDDEN // HEADS
    inter = target_config.intermediate_size
    ids = torch.tensor(draft_ids if draft_ids is not None else list(range(VOCAB)))
    shapes = {
        "self_attn.q_proj.weight": (HEADS * dim, 2 * HIDDEN),
        "self_attn.k_proj.weight": (KV_HEADS * dim, 2 * HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * dim, 2 * HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HEADS * dim),
        "mlp.gate_proj.weight": (inter, HIDDEN),
        "mlp.up_proj.weight": (inter, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, inter),
    }
    prefix = "midlayer." if layout == "vllm" else "layers.0."
    tensors = {prefix + name: torch.randn(shape, generator=generator) * 0.2 for name, shape in shapes.items()}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    num_taps = len(set(layer_ids)) if layer_ids else 3
    tensors["fc.weight"] = torch.randn(HIDDEN, num_taps * HIDDEN, generator=generator) * 0.1
    tensors["norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    tensors["lm_head.weight"] = torch.randn(len(ids), HIDDEN, generator=generator)
    if own_embed:
        tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator)
    tensors = {name: t.half() for name, t in tensors.items()}
    tensors["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    layer = {
        "hidden_size": HIDDEN,
        "intermediate_size": inter,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": target_config.rms_norm_eps,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "model_type": "llama",
        "torch_dtype": "float16",
    }
    if layout == "vllm":  # SpecForge's config, as vLLM's llama_eagle3.py reads it
        config = layer | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(ids)}
        config["norm_before_residual"] = norm_before_residual
        if layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "transformer_layer_config": layer,
            "draft_vocab_size": len(ids),
            "norm_before_residual": norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": layer_ids,
        }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# A reference forward from vLLM's llama_eagle3.py -------------------------------------------------------


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):
    """Neox-style rotary embedding of ``x`` [T, heads, dim] at ``positions`` [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = positions[:, None].double() * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return (x.double() * cos + rotated.double() * sin).to(x.dtype)


class VllmEagle3Reference:
    """One sequence through vLLM's Eagle3 ``LlamaModel.forward`` with a growing KV cache, read from the checkpoint's
    own tensors: layer 0 normalizes the embeddings (``input_layernorm``) and the feature (``hidden_norm``, the
    residual before or after it per ``norm_before_residual``), q/k/v read the 2H concatenation; the fused
    ``post_attention_layernorm(h, residual)`` and final ``norm(h, residual)`` add the residual first; ``forward``
    returns (normed, prenorm) and the proposer chains prenorm."""

    def __init__(self, folder: Path, embed: torch.Tensor, eps: float):
        from safetensors.torch import load_file

        config = json.loads((folder / "config.json").read_text())
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        raw = load_file(str(folder / "model.safetensors"))
        self.w = {k.replace("layers.0.", "midlayer."): v.float() for k, v in raw.items() if v.is_floating_point()}
        self.embed = self.w.get("embed_tokens.weight", embed)
        self.eps = eps
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def step(self, token: int, feature: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, eps, dim = self.w, self.eps, HIDDEN // HEADS
        embeds = _rms(self.embed[token], w["midlayer.input_layernorm.weight"], eps)
        if self.norm_before_residual:
            hidden = _rms(feature, w["midlayer.hidden_norm.weight"], eps)
            residual = hidden
        else:
            residual = feature
            hidden = _rms(feature, w["midlayer.hidden_norm.weight"], eps)
        x = torch.cat([embeds, hidden], -1)
        pos = torch.tensor([position])
        q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(1, HEADS, dim), pos)[0]
        k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(1, KV_HEADS, dim), pos)[0]
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(KV_HEADS, dim)
        self.keys.append(k), self.values.append(v)
        keys = torch.stack(self.keys, 1).repeat_interleave(HEADS // KV_HEADS, 0)  # [heads, T, dim]
        values = torch.stack(self.values, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        probs = torch.softmax((keys @ q[:, :, None])[..., 0] / dim**0.5, -1)  # [heads, T]
        attn = (probs[:, None, :] @ values)[:, 0].reshape(-1) @ w["midlayer.self_attn.o_proj.weight"].T
        residual = attn + residual  # post_attention_layernorm(hidden, residual)
        hidden = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = hidden @ w["midlayer.mlp.gate_proj.weight"].T, hidden @ w["midlayer.mlp.up_proj.weight"].T
        hidden = (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        prenorm = hidden + residual  # norm(hidden, residual)
        logits = _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T
        return logits, prenorm


# Tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_both_layouts_are_detected_and_read_alike(tmp_path, layout):
    """vLLM/SpecForge's and speculators' files are the EAGLE-3 kind and load to the same module."""
    target = tiny_target()
    folder = write_eagle3_head(tmp_path / layout, target.config, layout=layout, draft_ids=[4, 9, 2, 130], layer_ids=[1])
    assert detect_kind(folder) is KINDS["eagle3"] and KINDS["eagle3"].method == "eagle"
    head = load_eagle3(folder, target)
    assert head.draft_ids.tolist() == [4, 9, 2, 130] and head.aux_layer_ids == (1,)
    other = "speculators" if layout == "vllm" else "vllm"
    twin_dir = write_eagle3_head(tmp_path / other, target.config, layout=other, draft_ids=[4, 9, 2, 130], layer_ids=[1])
    twin = load_eagle3(twin_dir, target).state_dict()
    for name, tensor in head.state_dict().items():  # same seed: the same tensors under the other names
        assert torch.equal(twin[name], tensor), name


def test_speculators_options_qspec_does_not_run_are_refused(tmp_path):
    folder = write_eagle3_head(tmp_path, tiny_target().config, layout="speculators")
    config = json.loads((folder / "config.json").read_text()) | {"norm_output": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="norm_output"):
        load_eagle3(folder, tiny_target())


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("own_embed", [False, True])
def test_head_graph_equals_vllm_reference_with_chained_steps(tmp_path, norm_before_residual, own_embed):
    """The compiled head graph (ONNX Runtime, fused) equals the vLLM reference on a prompt's pairs, then on three
    chained steps that feed back its own pre-norm feature and draft: logits and features within 1e-4."""
    from tests.test_heads_export import compile_into, run_eagle

    target = tiny_target()
    draft_ids = [4, 9, 2, 130, 77, 300, 31]
    folder = write_eagle3_head(
        tmp_path / "head",
        target.config,
        draft_ids=draft_ids,
        norm_before_residual=norm_before_residual,
        own_embed=own_embed,
    )
    package, manifest = compile_into(tmp_path, folder, target)
    assert manifest.layout == "eagle3" and manifest.method == "eagle"
    sess = ort.InferenceSession(str(manifest.path(package, manifest.runtime_graph)), providers=["CPUExecutionProvider"])
    embed = target.get_input_embeddings().weight.detach().float()
    embed = embed.half().float()  # the head graph stores its tables as float16
    reference = VllmEagle3Reference(folder, embed, target.config.rms_norm_eps)

    generator = torch.Generator().manual_seed(11)
    steps = 6
    ids = torch.randint(0, VOCAB, (1, steps), generator=generator)
    feats = torch.randn(1, steps, HIDDEN, generator=generator)
    kv = [np.zeros((1, *manifest.kv_shape), np.float32) for _ in range(2)]
    logits, feature, kv = run_eagle(sess, ids, torch.arange(steps)[None], feats, kv)
    for t in range(steps):
        want_logits, want_feature = reference.step(int(ids[0, t]), feats[0, t], t)
    np.testing.assert_allclose(logits[0, 0], want_logits.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(feature[0, 0], want_feature.numpy(), atol=1e-4, rtol=1e-4)
    for t in range(steps, steps + 3):  # chained: the head's own draft and pre-norm feature
        token = draft_ids[int(logits[0, 0].argmax())]
        logits, feature, kv = run_eagle(
            sess, torch.tensor([[token]]), torch.tensor([[t]]), torch.from_numpy(feature), kv
        )
        want_logits, want_feature = reference.step(token, want_feature, t)
        np.testing.assert_allclose(logits[0, 0], want_logits.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(feature[0, 0], want_feature.numpy(), atol=1e-4, rtol=1e-4)
