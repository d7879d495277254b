"""Child processes that run the peer runtimes (ONNX Runtime GenAI, llama.cpp), one per loaded model.

Each speaks the transformers worker's protocol (:mod:`qspec.bench.workers`): after loading it sends
``{"load_s", "versions"}``; then it answers ``(variant, prompts, max_new_tokens)`` with one
:func:`answer` per prompt, and ``"stop"`` with its peak RSS. Prompts are token ids (the bench's chat
template, the same ids every configuration gets). Greedy; a request stops at one of the bench's
EOS ids (kept, as qspec keeps it), at ``max_new_tokens``, or at ``ctx_len``, as qspec's engine does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from qspec.bench.workers import serve_requests, timed_load

GREEDY = "greedy"
LOOKUP = "lookup"  # the peer's own n-gram / prompt-lookup speculation
ADAPTIVE = "adaptive"  # ONNX Runtime GenAI's n-gram with its adaptive K (where the installed version has it)


def answer(
    tokens: list[int],
    start: float,
    first: float | None,
    finish: float,
    *,
    calls: int,
    proposed: int = 0,
    accepted: int = 0,
) -> dict[str, Any]:
    """One request as the worker sends it; ``calls``: the model's decode calls after the prefill."""
    return {
        "tokens": tokens,
        "start": start,
        "first": first or finish,
        "finish": finish,
        "calls": calls,
        "proposed": proposed,
        "accepted": accepted,
    }


def serve(conn, what: str, load: Callable[[], dict[str, str]], generate: Callable[[str, list[int], int], dict]) -> None:
    """Load, then answer ``(variant, prompts, max_new_tokens)`` until ``"stop"``
    (:func:`~qspec.bench.workers.serve_requests`)."""

    def answer(message) -> list[dict]:
        variant, prompts, max_new_tokens = message
        return [generate(variant, ids, max_new_tokens) for ids in prompts]

    serve_requests(conn, what, timed_load(load), answer)


# --------------------------------------------------------------------------------------------
# ONNX Runtime GenAI
# --------------------------------------------------------------------------------------------


def ort_genai_overlay(threads: int, eos_token_ids: list[int]) -> str:
    """``og.Config.overlay`` JSON: the decoder session on ``threads`` threads, stopping at the bench's EOS ids."""
    session = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    return json.dumps({"model": {"eos_token_id": eos_token_ids, "decoder": {"session_options": session}}})


def ort_genai_main(
    conn, folder: str, threads: int, eos_token_ids: list[int], ctx_len: int, speculative: dict[str, dict]
) -> None:
    """Child: an ONNX Runtime GenAI model; variant ``greedy``, or one of ``speculative`` (``lookup``,
    ``adaptive``): ``set_speculative_options(**speculative[variant])``."""
    state: dict[str, Any] = {}
    eos = set(eos_token_ids)

    def load() -> dict[str, str]:
        import onnxruntime
        import onnxruntime_genai as og

        config = og.Config(folder)
        config.overlay(ort_genai_overlay(threads, eos_token_ids))
        state["og"], state["model"] = og, og.Model(config)
        return {"onnxruntime-genai": og.__version__, "onnxruntime": onnxruntime.__version__}

    def generate(variant: str, ids: list[int], max_new_tokens: int) -> dict:
        og, model = state["og"], state["model"]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=min(len(ids) + max_new_tokens, ctx_len), do_sample=False)
        if variant in speculative:
            params.set_speculative_options(**speculative[variant])
        tokens: list[int] = []
        first = None
        start = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(ids)  # the prefill
        while not generator.is_done():
            generator.generate_next_token()
            tokens += [int(t) for t in generator.get_next_tokens()]
            first = first or time.perf_counter()
            if tokens and tokens[-1] in eos:
                break
        finish = time.perf_counter()
        if variant not in speculative:
            return answer(tokens, start, first, finish, calls=max(len(tokens) - 1, 0))
        stats = generator.get_speculative_stats()
        # Verification rounds and plain steps after a lookup miss are both decode calls of the model.
        calls = int(stats["target_forward_passes"] + stats["standard_fallback_steps"])
        return answer(
            tokens,
            start,
            first,
            finish,
            calls=calls,
            proposed=int(stats["draft_tokens_proposed"]),
            accepted=int(stats["draft_tokens_accepted"]),
        )

    serve(conn, "ONNX Runtime GenAI", load, generate)


# --------------------------------------------------------------------------------------------
# llama.cpp (llama-cpp-python)
# --------------------------------------------------------------------------------------------


class _Counting:
    """Wraps a callable and counts calls, and the length of what it returns (a draft's tokens)."""

    def __init__(self, inner: Callable) -> None:
        self.inner, self.calls, self.returned = inner, 0, 0

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.calls += 1
        self.returned += len(out) if out is not None and hasattr(out, "__len__") else 0
        return out

    def reset(self) -> None:
        self.calls = self.returned = 0


def llama_cpp_main(conn, gguf: str, threads: int, eos_token_ids: list[int], ctx_len: int, num_pred_tokens: int) -> None:
    """Child: two llama.cpp contexts on one GGUF: ``greedy``, and ``lookup`` with ``LlamaPromptLookupDecoding``.

    Two contexts because prompt lookup needs the logits of every position (``logits_all``), which
    would slow the greedy one's prefill. Each request starts from an empty KV cache (``reset``):
    llama-cpp-python would otherwise reuse the previous prompt's common prefix, which qspec does not.
    """
    llamas: dict[str, Any] = {}
    evals: dict[str, _Counting] = {}
    drafts: dict[str, _Counting] = {}
    eos = set(eos_token_ids)

    def load() -> dict[str, str]:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = {"n_ctx": ctx_len, "n_threads": threads, "n_threads_batch": threads, "verbose": False, "seed": 0}
        llamas[GREEDY] = llama_cpp.Llama(model_path=gguf, **common)
        drafts[LOOKUP] = _Counting(LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens))
        llamas[LOOKUP] = llama_cpp.Llama(model_path=gguf, draft_model=drafts[LOOKUP], **common)
        for variant, llm in llamas.items():
            evals[variant] = llm.eval = _Counting(llm.eval)  # one model call per eval (the prefill included)
        return {"llama-cpp-python": llama_cpp.__version__}

    def generate(variant: str, ids: list[int], max_new_tokens: int) -> dict:
        llm = llamas[variant]
        llm.reset()
        evals[variant].reset()
        if variant in drafts:
            drafts[variant].reset()
        budget = min(max_new_tokens, ctx_len - len(ids))
        tokens: list[int] = []
        first = None
        start = time.perf_counter()
        sampling = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
        for token in llm.generate(ids, reset=True, **sampling):
            first = first or time.perf_counter()
            tokens.append(int(token))
            if token in eos or len(tokens) >= budget:
                break
        finish = time.perf_counter()
        calls = max(evals[variant].calls - 1, 0)
        if variant not in drafts:
            return answer(tokens, start, first, finish, calls=calls)
        # A call verifies its drafts; tokens beyond one per call (and the prefill's) were accepted drafts.
        accepted = max(len(tokens) - 1 - calls, 0)
        return answer(tokens, start, first, finish, calls=calls, proposed=drafts[variant].returned, accepted=accepted)

    serve(conn, "llama.cpp", load, generate)


def hf_folder_main(conn, gguf: str, folder: str) -> None:
    """Child: write ``gguf`` as a Hugging Face folder (for ONNX Runtime GenAI's builder)."""
    try:
        from qspec.bench.peers.models import write_hf_folder

        write_hf_folder(gguf, folder)
        conn.send({"folder": folder})
    except Exception as exc:  # sent to the parent, which raises it as a BenchError
        conn.send({"error": f"writing a Hugging Face folder: {type(exc).__name__}: {exc}"})
    finally:
        conn.close()
