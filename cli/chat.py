"""``qspec chat``: an interactive conversation with a package (the answer streams; Ctrl-C ends the turn)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

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

HELP = "/reset forgets the conversation, /history sizes it, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer."


def chat(
    package: Annotated[Path, typer.Argument(metavar="PACKAGE", help="A package directory written by `qspec compile`.")],
    method: MethodOption = "pld",
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens of one answer.")] = 512,
    system: Annotated[Optional[str], typer.Option(help="A system message that starts the conversation.")] = None,
    prompt_lookup_min: Annotated[int, typer.Option(help="pld: smallest n-gram to match.")] = 1,
    prompt_lookup_max: Annotated[int, typer.Option(help="pld: largest n-gram to match.")] = 3,
    draft_package: DraftPackageOption = None,
    draft_confidence_threshold: DraftThresholdOption = None,
    tree_width: TreeWidthOption = None,
    dispatch: DispatchOption = "auto",
    backend: Annotated[Backend, typer.Option(help="ort (ONNX Runtime, CPU) or qaic (the package's QPC).")] = "ort",
    num_threads: Annotated[Optional[int], typer.Option(help="ONNX Runtime threads (default: all cores).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    stats: Annotated[bool, typer.Option(help="After each answer: tokens, tokens/s, tokens per call (stderr).")] = True,
) -> None:
    """Chat with PACKAGE: each line you type is a user message, the answer streams back, the history is kept.

    /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops the answer (not the conversation).
    """
    with cli_errors():
        from qspec.runtime import Engine, SamplingParams
        from qspec.runtime.config import EngineConfig
        from qspec.runtime.conversation import Conversation

        params = SamplingParams.create(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
        )
        config = EngineConfig.create(
            method=method,
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
        conversation = Conversation(system=system)
        conversation.prompt_ids(engine.tokenizer, ctx_len=engine.model.ctx_len, max_new_tokens=0)  # has a template
        console.print(f"[dim]{escape(package.name)} ({escape(engine.method)}). {escape(HELP)}[/]")
        _loop(engine, conversation, params, stats=stats)


def _read_line() -> str | None:
    """The next line typed (None at end of input); Ctrl-C at the prompt says how to leave and asks again."""
    while True:
        try:
            return input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return None
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            console.print(f"[dim]{escape(HELP)}[/]")


def _loop(engine, conversation, params, *, stats: bool) -> None:
    from qspec.errors import ConfigError

    _enable_line_editing()
    # Ctrl-C stops an answer even when qspec was started with SIGINT ignored (nohup, a parent that ignores it:
    # Python then installs no handler of its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while (line := _read_line()) is not None:
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return
        if text == "/reset":
            conversation.reset()
            console.print("[dim]conversation reset[/]")
            continue
        if text == "/history":
            ids, _ = conversation.prompt_ids(engine.tokenizer, ctx_len=engine.model.ctx_len, max_new_tokens=0)
            console.print(f"[dim]{len(conversation.turns)} message(s), {len(ids)} tokens in the context[/]")
            continue
        if text.startswith("/") and " " not in text:
            console.print(f"[yellow]Unknown command {escape(text)}:[/] {escape(HELP)}")
            continue
        conversation.add("user", line)
        try:
            ids, dropped = conversation.prompt_ids(
                engine.tokenizer, ctx_len=engine.model.ctx_len, max_new_tokens=params.max_new_tokens
            )
            if dropped:
                console.print(f"[dim]({dropped} oldest turn(s) dropped to fit the context)[/]")
            answer = _answer(engine, ids, params, stats=stats)
        except ConfigError as exc:
            console.print(f"[red]Error:[/] {escape(str(exc))}")
            continue
        except KeyboardInterrupt:  # before the answer began: the turn ends, the conversation goes on
            sys.stdout.write("\n")
            console.print("[dim](answer stopped)[/]")
            answer = ""
        conversation.add("assistant", answer)


def _answer(engine, ids: list[int], params, *, stats: bool) -> str:
    """Stream one answer; Ctrl-C stops it and keeps what came (the engine frees the request)."""
    parts: list[str] = []

    def on_text(index: int, text: str) -> None:
        parts.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    start = time.perf_counter()
    try:
        engine.generate([ids], params, on_text=on_text)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        console.print("[dim](answer stopped)[/]")
        return "".join(parts)
    sys.stdout.write("\n")
    if stats:
        metrics = engine.last_metrics
        seconds = time.perf_counter() - start
        console.print(
            f"[dim]({metrics.output_tokens} tokens, {metrics.output_tokens / seconds:.1f} tokens/s, "
            f"{metrics.mean_accepted_tokens:.2f} tokens per call)[/]"
        )
    return "".join(parts)


def _enable_line_editing() -> None:
    """Arrow keys and history at the prompt, where Python has readline (on a terminal)."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it turns line editing on for input())
        except ImportError:  # pragma: no cover - Windows
            pass
