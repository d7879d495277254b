"""What every command shares: the error boundary, progress on stderr."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

console = Console(stderr=True, highlight=False)

# Options more than one command takes: one definition each (flag, help), one default.
DEFAULT_CTX_LEN = 1024
# Tokens per prefill call. `make bench`'s TTFT per chunk size (16 MT-bench chat prompts, 44-233 tokens,
# SmolLM2, batch 1, 2 interleaved rounds, 2026-11-24): fp32 172 / 153 / 139 / 126 / 128 ms and int4 142 /
# 133 / 121 / 114 / 113 ms at 16 / 32 / 64 / 128 / 256. Longer chunks gain 6-9 % more but would refuse
# every --ctx-len or prefill bucket below them; 64 keeps small contexts compiling.
DEFAULT_PREFILL_SEQ_LEN = 64
KsOption = Annotated[
    str, typer.Option("--num-speculative-tokens", "-k", help="Speculative lengths K to compile, e.g. 0,4.")
]
PrefillSeqLenOption = Annotated[int, typer.Option(help="Tokens per prefill call.")]
CtxLenOption = Annotated[int, typer.Option(help="KV cache length (prompt + output).")]
BatchSizeOption = Annotated[int, typer.Option(help="Rows per prefill call.")]
FullBatchSizeOption = Annotated[Optional[int], typer.Option(help="KV slots for continuous batching.")]
SpecFormatOption = Annotated[str, typer.Option(help="specializations.json format: flat or named.")]
CclPrefillOption = Annotated[
    Optional[str], typer.Option(help="Compute-context-length buckets of the prefill shapes, e.g. 256,1024.")
]
CclDecodeOption = Annotated[
    Optional[str], typer.Option(help="Compute-context-length buckets of the decode shapes, e.g. 256,512,1024.")
]
DraftPackageOption = Annotated[Optional[Path], typer.Option(help="The draft model's package (method draft).")]
DispatchOption = Annotated[
    str,
    typer.Option(
        help="cover: smallest K covering the drafts; cost: most tokens per ms; auto: cost for greedy steps "
        "with several KV slots or an int8/int4 package, cover otherwise."
    ),
]


def debug_enabled() -> bool:
    return os.environ.get("QSPEC_DEBUG", "") not in ("", "0")


def run_guarded(work: Callable[[], None]) -> None:
    """Run a command body: a QSpecError (or Ctrl-C) is one line on stderr and exit code 1.

    Any other exception is a bug: one line plus a hint to rerun with ``--debug`` for the traceback.
    """
    from qspec.errors import QSpecError

    try:
        work()
    except typer.Exit:
        raise
    except QSpecError as exc:
        if debug_enabled():
            raise
        console.print(f"[red]Error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("[red]Interrupted.[/]")
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug_enabled():
            raise
        console.print(
            f"[red]Error:[/] {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", soft_wrap=True
        )
        raise typer.Exit(1) from None


@contextlib.contextmanager
def status(title: str) -> Iterator[Callable[[str], None]]:
    """A rich spinner on stderr; yields ``say(message)`` that updates it and logs the phase."""
    import time

    start = time.perf_counter()
    if not console.is_terminal:

        def say(message: str) -> None:
            console.print(f"[dim]{time.perf_counter() - start:6.1f}s[/] {message}")

        yield say
        return
    with console.status(title) as spinner:

        def say(message: str) -> None:
            console.print(f"[dim]{time.perf_counter() - start:6.1f}s[/] {message}")
            spinner.update(message)

        yield say
