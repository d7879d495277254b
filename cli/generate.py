"""``qspec generate``: prompts in, text (or JSON) out, through one :class:`~qspec.runtime.Engine`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from qspec_cli.common import (
    Backend,
    DispatchOption,
    DraftPackageOption,
    DraftThresholdOption,
    MethodOption,
    TreeWidthOption,
    cli_errors,
    console,
    escape,
    status,
)

if TYPE_CHECKING:
    from qspec.runtime import RequestOutput
    from qspec.runtime.metrics import EngineMetrics


def _generate_prompts(prompt: Optional[str], prompts_file: Optional[Path]) -> list:
    """The prompts of ``--prompt`` or ``--prompts-file`` (a conversation line is one chat prompt)."""
    from qspec.errors import ConfigError
    from qspec.prompts import read_generate_prompts

    if (prompt is None) == (prompts_file is None):
        raise ConfigError("give exactly one of --prompt TEXT or --prompts-file FILE.jsonl")
    if prompt is not None:
        return [prompt]
    prompts, multi_turn = read_generate_prompts(prompts_file)
    if multi_turn:
        console.print(
            f"[yellow]Note:[/] {multi_turn} record(s) of {escape(str(prompts_file))} have several turns: generate "
            'runs each first turn (a later turn needs the answer before it: give {"messages": [...]} lines, '
            "or run `qspec bench --turns 2`)"
        )
    return prompts


def summary_lines(metrics: EngineMetrics) -> list[str]:
    """The run's numbers, one labelled line each (TTFT and TPOT are medians over the requests)."""
    calls = ", ".join(f"K={k}: {n}" for k, n in metrics.calls.items() if k != "prefill")
    rows = [
        ("requests", f"{metrics.requests}"),
        ("output tokens", f"{metrics.output_tokens} in {metrics.wall_s:.2f} s"),
        ("throughput", f"{metrics.output_tokens_per_s:.1f} tokens/s"),
        ("TTFT (median)", f"{metrics.ttft_ms_median:.0f} ms"),
        ("TPOT (median)", f"{metrics.tpot_ms_median:.1f} ms"),
        ("tokens per call", f"{metrics.mean_accepted_tokens:.2f}"),
        ("acceptance", f"{metrics.acceptance_rate:.0%} of {metrics.proposed} drafts"),
        ("calls", f"prefill: {metrics.calls.get('prefill', 0)}, {calls}"),
    ]
    return [f"{label:<16} {value}" for label, value in rows]


def _json_document(outputs: list[RequestOutput], metrics: EngineMetrics | None) -> str:
    requests = [o.to_dict() for o in sorted(outputs, key=lambda o: o.index)]
    document = {"requests": requests, "metrics": metrics.to_dict() if metrics else None}
    if metrics is None:
        document["interrupted"] = True
    return json.dumps(document, indent=2)


def generate(
    package: Annotated[Path, typer.Argument(metavar="PACKAGE", help="A package directory written by `qspec compile`.")],
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="One prompt.")] = None,
    prompts_file: Annotated[
        Optional[Path],
        typer.Option(help='JSONL file, one prompt a line: {"prompt": ...}, {"messages": [...]} or {"turns": [...]}.'),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option(help="Most tokens to generate per prompt (prompt + this must fit the package's ctx_len).")
    ] = 128,
    method: MethodOption = "pld",
    prompt_lookup_min: Annotated[int, typer.Option(help="pld: smallest n-gram to match.")] = 1,
    prompt_lookup_max: Annotated[int, typer.Option(help="pld: largest n-gram to match.")] = 3,
    draft_package: DraftPackageOption = None,
    draft_confidence_threshold: DraftThresholdOption = None,
    tree_width: TreeWidthOption = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help="Sequences in flight (default: all KV slots).")] = None,
    dispatch: DispatchOption = "auto",
    backend: Annotated[
        Backend, typer.Option(help="ort (ONNX Runtime, CPU) or qaic (the package's QPC on Cloud AI 100).")
    ] = "ort",
    num_threads: Annotated[Optional[int], typer.Option(help="ONNX Runtime threads (default: all cores).")] = None,
    chat: Annotated[
        Optional[bool],
        typer.Option(
            "--chat/--no-chat",
            help="Text prompts through the tokenizer's chat template (default: when it has one; messages lines "
            "always); --no-chat sends them raw.",
            show_default=False,
        ),
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    stop: Annotated[
        Optional[list[str]], typer.Option(metavar="TEXT", help="Stop string (repeatable; empty ones are ignored).")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option(help="Generate --max-new-tokens tokens whatever the model says (fixed-length runs).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print token ids, text and metrics per request as one JSON document.")
    ] = False,
    jsonl: Annotated[
        bool,
        typer.Option("--jsonl", help="Print one JSON line per request as it finishes (token ids, text, metrics)."),
    ] = False,
) -> None:
    """Generate text from a compiled package with speculative decoding.

    With several prompts each result prints as it finishes; Ctrl-C keeps the finished ones (--json and
    --jsonl too).
    """
    with cli_errors():
        from qspec.errors import ConfigError
        from qspec.runtime import Engine, SamplingParams
        from qspec.runtime.config import EngineConfig
        from qspec.runtime.request import check_budget

        if as_json and jsonl:
            raise ConfigError("give one of --json (one document at the end) or --jsonl (a line per request)")
        prompts = _generate_prompts(prompt, prompts_file)
        params = SamplingParams.create(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop or [],
            ignore_eos=ignore_eos,
        )
        # Each method takes the knobs it knows (qspec.runtime.proposers.make_proposer).
        config = EngineConfig.create(
            method=method,
            max_batch_size=max_batch_size,
            dispatch=dispatch,
            backend=backend,
            num_threads=num_threads,
            prompt_lookup_min=prompt_lookup_min,
            prompt_lookup_max=prompt_lookup_max,
            draft_package=draft_package,
            draft_confidence_threshold=draft_confidence_threshold,
            tree_width=tree_width,
        )
        with status("loading the package"):
            engine = Engine(package, config)
        use_chat = chat if chat is not None else engine.tokenizer.chat_template is not None
        encoded = [engine.tokenizer.encode_prompt(p, chat=use_chat) for p in prompts]
        for i, ids in enumerate(encoded):
            check_budget(
                "the prompt" if prompt is not None else f"prompt {i}", ids, max_new_tokens, engine.model.ctx_len
            )
        _run_generate(engine, encoded, params, as_json=as_json, jsonl=jsonl, chat=use_chat)


def ended_at_once(output: RequestOutput, *, chat: bool) -> str | None:
    """A warning when ``output`` ended on end of sequence before any text, else None: an instruct model
    given a raw prompt (or a base model given a chat one) often ends at once, and an empty answer alone
    says nothing."""
    if output.finish_reason != "stop" or len(output.token_ids) > 1 or output.text:
        return None
    fix = "the prompt went through the chat template: try --no-chat" if chat else "try --chat"
    return f"request {output.index} ended at once on end of sequence ({fix})"


def _run_generate(engine, encoded: list[list[int]], params, *, as_json: bool, jsonl: bool = False, chat=True) -> None:
    """Generate, printing text as it comes (one prompt) or each result as it finishes (several; --jsonl: a
    JSON line each, so Ctrl-C loses none)."""
    finished: list[RequestOutput] = []
    stream = not as_json and not jsonl and len(encoded) == 1

    def on_text(index: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def on_output(output: RequestOutput) -> None:
        finished.append(output)
        if jsonl:
            print(json.dumps(output.to_dict()), flush=True)
        elif not as_json and not stream:
            print(f"--- {output.index}\n{output.text}", flush=True)
        warning = ended_at_once(output, chat=chat)
        if warning:
            console.print(f"[yellow]Warning:[/] {escape(warning)}")

    try:
        engine.generate(encoded, params, on_text=on_text if stream else None, on_output=on_output)
    except KeyboardInterrupt:
        if stream:
            sys.stdout.write("\n")
        if as_json:
            print(_json_document(finished, None))
        console.print(f"[red]Interrupted:[/] {len(finished)} of {len(encoded)} requests finished")
        raise typer.Exit(130) from None
    metrics = engine.last_metrics
    if as_json:
        print(_json_document(finished, metrics))
        return
    if stream:
        sys.stdout.write("\n")
    for line in summary_lines(metrics):
        console.print(f"[dim]{escape(line)}[/]")
