"""``qspec bench``: qspec's speculative configurations against no speculation and baselines, in one run.

What one run does, in order (:func:`run_bench`):

1. **Packages** (:mod:`.packages`): given a model (``.gguf`` or a Hugging Face folder) it compiles,
   through the export cache, one package per max batch size with every K of every K list (plus 0),
   and one batch-1 package per other weight format (``weight_formats``, e.g. int4: ``none`` and the
   variable K lists run on it, named ``none-int4``, ``pld[0,4]-int4``):
   batch 1 is a plain ``batch_size=1`` package, batch B > 1 a continuous-batching one with
   ``full_batch_size=B``. A configuration restricts the engine to its own Ks, so ``none``,
   ``pld[4]`` and ``pld[0,4]`` all run on the same loaded weights. One more package with K=0 only
   is compiled for the memory comparison (1 vs 5 specializations). With ``draft_head`` every package
   holds that head (``qspec compile --draft-head``) and its method and ``+pld`` run where ``pld`` runs.
2. **Micro-benchmark** (:mod:`.micro`): the median time of one call per specialization of every
   package, against its weight format's memory-bandwidth floor ``weight bytes / copy bandwidth``;
   and of each specialization of a package's draft head.
3. **Timed rounds** (:mod:`.run`): the prompts are cut into rounds of ``round_size``; every round
   runs every configuration, the order rotated by one each round. Each runtime runs behind a
   :class:`~qspec.bench.runners.Runner`: qspec's engine, and the transformers baselines
   (``generate(do_sample=False)`` and ``generate(prompt_lookup_num_tokens=4)``, batch 1) in a worker
   process (:mod:`.workers`). Every configuration gets the same token ids. With ``turns=2`` a
   second phase asks each MT-bench follow-up, with ``none``'s first answer fed back.
4. **Memory** (:mod:`.memory`): one spawned process per configuration loads its engine, generates a
   little and reports its RSS after loading and its peak.
5. **Checks** (:mod:`.analysis`): every configuration's greedy tokens against ``none``'s of the same
   weight format at the same batch size (and the other formats' and the baselines' against fp32
   ``none``, as agreement); the speculation ceiling (:mod:`.ceiling`), head drafts replayed on the
   target's hidden states. The bench measures and reports; the project's own goals live outside the
   package (``bench/targets.py`` reads ``report.json``).

The report is a typed :class:`~qspec.bench.report.BenchReport`; :func:`write_report` writes
``report.json``, ``report.md`` and ``throughput.png`` (:mod:`.render`). Library code never prints:
progress goes to the ``progress(message, done, total)`` callback.
"""

from qspec.bench.analysis import category_rates, compare_outputs, contention_notes, equality_checks, ratio, with_ratios
from qspec.bench.machine import CpuMeter, copy_bandwidth
from qspec.bench.options import (
    SPECULATIVE_METHODS,
    WEIGHT_FORMATS,
    BenchOptions,
    bench_options,
    full_options,
    quick_options,
)
from qspec.bench.plan import HF_GREEDY, HF_LOOKUP, RunConfig, none_config, plan_configs, rotated, rounds
from qspec.bench.render import render_markdown, write_report
from qspec.bench.report import BenchReport, ConfigSummary
from qspec.bench.run import run_bench
from qspec.bench.runners import RequestResult, RoundResult, Runner
from qspec.bench.workers import BenchError
from qspec.prompts import PromptRecord, default_prompts_path, load_prompts

__all__ = [
    "SPECULATIVE_METHODS",
    "WEIGHT_FORMATS",
    "HF_GREEDY",
    "HF_LOOKUP",
    "BenchError",
    "BenchOptions",
    "BenchReport",
    "ConfigSummary",
    "CpuMeter",
    "PromptRecord",
    "RequestResult",
    "RoundResult",
    "RunConfig",
    "Runner",
    "category_rates",
    "compare_outputs",
    "contention_notes",
    "copy_bandwidth",
    "default_prompts_path",
    "equality_checks",
    "bench_options",
    "full_options",
    "load_prompts",
    "none_config",
    "plan_configs",
    "quick_options",
    "ratio",
    "render_markdown",
    "rotated",
    "rounds",
    "run_bench",
    "with_ratios",
    "write_report",
]
