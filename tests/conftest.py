"""Shared fixtures: tiny random models of every supported family, saved as real HF folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "granite",
    "olmo2",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
)
VOCAB = 320  # 256 byte tokens + 3 specials fit below this


def pytest_configure(config):
    """Under pytest-xdist each worker runs on its own core (worker i on core i mod cores), so sessions that size
    their thread pools by the cores they may use (ONNX Runtime's spinning pools, torch) never fight each other."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and len(cores) > 1:
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every text encodes, vocabulary 259 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {ch: i + 3 for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def tiny_config(family: str, *, tie: bool = True, layers: int = 2):
    """A small config of ``family`` with GQA (4 query heads, 2 KV heads)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "mistral":
        common["sliding_window"] = 6  # small, so the window matters in short tests
    if family == "qwen3":
        common["head_dim"] = 16
    common |= FAMILY_SETTINGS.get(family, {})
    return AutoConfig.for_model(family, **common)


# What makes each family differ from Llama, at sizes where it shows in short tests.
FAMILY_SETTINGS = {
    # fused qkv_proj and gate_up_proj; RoPE on half of each 32-wide head (16 features: what ONNX Runtime's
    # GroupQueryAttention takes, a multiple of 16)
    "phi3": dict(num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5, pad_token_id=0),
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0),
    "olmo2": dict(pad_token_id=0),  # q/k norms over all heads, norms after attention and MLP
    # sandwich norms, a window on layer 0, soft-capped scores and logits, its own query scale, scaled embeddings
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    ),
    # per-head q/k norms, a local layer (window, RoPE base 100) and a global one (base 1e6)
    "gemma3_text": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_local_base_freq=100.0,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # top-2 of 4, weights normalised
    # top-2 of 4, weights not normalised; layer 1 a dense MLP
    "qwen3_moe": dict(
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # multi-head latent attention (q and kv latents of rank 32 and 24; keys 16 + 16 wide, values 16), interleaved
    # RoPE; layer 0 dense, layer 1 MoE: top-2 of 8 experts in 4 groups, 2 groups kept, sigmoid scores with a
    # correction bias (save_tiny_model randomizes it), one shared expert, weights renormalised and scaled
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        head_dim=16,  # the RoPE width (an EAGLE head's Llama config takes it: GroupQueryAttention wants 16k)
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ),
}


def save_tiny_model(folder: Path, family: str, *, tie: bool = True, seed: int = 0, layers: int = 2) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tie=tie, layers=layers))
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias: zeros until trained
                buffer.normal_(0, 0.1)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Exports of tiny models go to a per-session cache; the real model's cache is kept across runs."""
    if "QSPEC_CACHE_DIR" not in os.environ:
        os.environ["QSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("qspec-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: ``tiny_model(family, tie=True)`` -> folder of a saved tiny random model (cached per session)."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", *, tie: bool = True, layers: int = 2) -> Path:
        key = (family, tie, layers)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{'tied' if tie else 'untied'}-{layers}")
            made[key] = save_tiny_model(folder, family, tie=tie, layers=layers)
        return made[key]

    return make


def bench_targets():
    """``bench/targets.py``, the project's goals (a script outside the package), loaded as a module."""
    import importlib.util
    import sys

    if "bench_targets" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "bench" / "targets.py"
        spec = importlib.util.spec_from_file_location("bench_targets", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_targets"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_targets"]
