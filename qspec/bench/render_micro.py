"""The micro-benchmark's sections of ``report.md``: call costs per specialization, draft-head calls, TTFT per
prefill chunk size (:mod:`qspec.bench.render` assembles the report)."""

from __future__ import annotations

from qspec.bench.markdown import fmt, table
from qspec.bench.report import BenchReport


def micro_sections(report: BenchReport) -> list[str]:
    micro = report.micro
    if not micro:
        return []
    lines = [
        "",
        "## One call per specialization",
        "",
        f"Copy bandwidth {micro.copy_bandwidth_gb_s} GB/s (numpy copy, read + write counted); "
        "floor = the package's own weight bytes (its weight format's) / bandwidth. Graph: the package's "
        "ONNX Runtime graph (runtime), or model.onnx as the qaic backend compiles it (vendor: explicit "
        "attention over the compute-context-length bucket's slots).",
        "",
    ]
    rows = [
        [
            p.weight_format,
            p.graph,
            p.batch,
            c.specialization,
            c.shape,
            c.tokens_per_call,
            c.median_ms,
            f"{p.floor_ms} ({p.weight_bytes / 1e6:.0f} MB)",
            c.ratio_to_floor,
        ]
        for p in micro.packages
        for c in p.calls
    ]
    header = ["weights", "graph", "batch", "specialization", "shape", "tokens/call", "median ms"]
    header += ["floor ms (bytes)", "x floor"]
    return lines + table(header, rows) + _head_calls(micro) + _prefill_chunks(micro)


def _head_calls(micro) -> list[str]:
    """One call per specialization of each package's draft head, against the target's K=0 call."""
    if not micro.heads:
        return []
    lines = [
        "",
        "## Draft head calls",
        "",
        "One call per specialization of each package's draft head in its own ONNX Runtime session, as the runtime "
        "runs it. EAGLE: a step drafting d tokens costs one catch-up call (its width: the pairs since the last "
        "step, up to K + 1) and d - 1 chained `seq_len=1` calls; Medusa: one call per step whatever d. x target "
        "K=0: the head call against the same package's cheapest decode call.",
        "",
    ]
    rows = [
        [
            h.weight_format,
            h.batch,
            h.method,
            c.specialization,
            c.shape,
            fmt(c.median_ms, 3),
            fmt(h.target_k0_ms),
            fmt(c.median_ms / h.target_k0_ms if h.target_k0_ms else None, 3),
            f"{h.floor_ms} ({h.weight_bytes / 1e6:.1f} MB)",
            c.ratio_to_floor,
        ]
        for h in micro.heads
        for c in h.calls
    ]
    header = ["weights", "batch", "head", "specialization", "shape", "median ms", "target K=0 ms", "x target K=0"]
    return lines + table(header + ["floor ms (bytes)", "x floor"], rows)


def _prefill_chunks(micro) -> list[str]:
    """TTFT per prefill chunk size, each format against its package's own chunk size."""
    if not micro.prefill:
        return []
    lines = [
        "",
        "## TTFT per prefill chunk size",
        "",
        f"Batch 1, `none`, the first turn of {micro.prefill_prompts} prompts, {micro.prefill_rounds} rounds "
        "interleaved prompt by prompt; each batch-1 package loaded once per size with that "
        "`prefill_seq_len` (what it runs compiled with `--prefill-seq-len`). Calls per prompt: prefill "
        "chunks plus the decode-shape calls that finish a prompt's tail. **Bold**: the package's own size.",
        "",
    ]
    own = {c.weight_format: c.ttft_median_ms for c in micro.prefill if c.package_default}
    rows = []
    for c in micro.prefill:
        size = f"**{c.prefill_seq_len}**" if c.package_default else str(c.prefill_seq_len)
        ratio = fmt(c.ttft_median_ms / own[c.weight_format], 2) if c.weight_format in own else "–"
        rows.append([c.weight_format, size, c.ttft_median_ms, c.prefill_calls_per_prompt, ratio])
    header = ["weights", "prefill_seq_len", "TTFT ms (median)", "calls per prompt", "x own size"]
    return lines + table(header, rows)
