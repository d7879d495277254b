"""What every command shares: the error boundary, progress on stderr."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

# stderr, never hard-wrapped (a piped log keeps paths whole); every message text goes through `escape`:
# rich would take `[serve]` in `pip install 'qspec[serve]'` or `run[fp16]/pkg` for markup.
console = Console(stderr=True, highlight=False, soft_wrap=True)

# Options more than one command takes: one definition each (flag, help), one default.
DEFAULT_CTX_LEN = 1024
# Tokens per prefill call: longer chunks prefill a little faster but refuse every --ctx-len or prefill
# bucket below them; 64 keeps small contexts compiling (TTFT per chunk size: docs/bench/report.md).
DEFAULT_PREFILL_SEQ_LEN = 64
KsOption = Annotated[
    str, typer.Option("--num-speculative-tokens", "-k", help="Speculative lengths K to compile, e.g. 0,4.")
]
PrefillSeqLenOption = Annotated[int, typer.Option(help="Tokens per prefill call.")]
CtxLenOption = Annotated[int, typer.Option(help="KV cache length (prompt + output).")]
BatchSizeOption = Annotated[int, typer.Option(help="Rows per prefill call.")]
FullBatchSizeOption = Annotated[Optional[int], typer.Option(help="KV slots for continuous batching.")]
KvCacheBatchSizeOption = Annotated[
    Optional[int],
    typer.Option(help="KV slots when more than --full-batch-size (those decode per step; the rest keep prefixes)."),
]
SpecFormatOption = Annotated[str, typer.Option(help="specializations.json format: flat or named.")]
CclPrefillOption = Annotated[
    Optional[str], typer.Option(help="Compute-context-length buckets of the prefill shapes, e.g. 256,1024.")
]
CclDecodeOption = Annotated[
    Optional[str], typer.Option(help="Compute-context-length buckets of the decode shapes, e.g. 256,512,1024.")
]
# The choices help shows and the parser checks (the library's names: tests/test_cli_ux.py keeps them equal).
# ``user`` (a Python callable's drafts) is the library's alone: a command line cannot pass a callable.
Backend = Literal["ort", "qaic"]
WeightFormat = Literal["fp32", "int8", "int4"]
Method = Literal[
    "none",
    "pld",
    "ngram",
    "suffix",
    "draft",
    "eagle",
    "medusa",
    "mtp",
    "eagle+pld",
    "medusa+pld",
    "mtp+pld",
    "eagle3",
    "eagle3+pld",
]
MethodOption = Annotated[
    Method,
    typer.Option(
        help="Speculative method: none, pld (prompt lookup; alias ngram), suffix, draft (--draft-package), or with "
        "the package's draft head (compile --draft-head, --mtp) eagle (alias eagle3), medusa, mtp, and each +pld."
    ),
]
DraftPackageOption = Annotated[Optional[Path], typer.Option(help="The draft model's package (method draft).")]
DraftThresholdOption = Annotated[
    Optional[float],
    typer.Option(
        min=0.0,
        max=1.0,
        help="Heads and draft models: a draft chain stops at a draft whose probability is below this "
        "(default: eagle/medusa 0.5, draft 0 = off).",
    ),
]
TreeWidthOption = Annotated[
    Optional[int],
    typer.Option(
        min=1,
        max=2,
        help="eagle: 2 verifies the head's runner-up for the first draft beside the chain (a tree: ort with one "
        "KV slot, or a qaic package; else the chain); default 1, the chain.",
    ),
]
DispatchOption = Annotated[
    str,
    typer.Option(
        help="cover: the smallest K covering the drafts; cost: the most expected tokens per ms (drafts that "
        "do not pay are dropped); auto: cost for greedy steps, cover when sampling and on a one-slot graph that "
        "pads every row to K + 1 (the vendor graph)."
    ),
]


class Command(TyperCommand):
    """A command whose usage line names its arguments as the help does (``qspec info [OPTIONS] PACKAGE``,
    not typer's ``{package}``)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


def debug_enabled() -> bool:
    return os.environ.get("QSPEC_DEBUG", "") not in ("", "0")


def name_flags(message: str) -> str:
    """The running command's options as the user typed them, not as the library's fields:
    ``max_new_tokens=0: ...`` -> ``--max-new-tokens 0: ...``, ``max_batch_size 9 must ...`` ->
    ``--max-batch-size 9 must ...`` (a one-word name only before ``=``: prose keeps its words)."""
    try:  # typer >= 0.22 carries its own click
        from typer._click.globals import get_current_context
    except ImportError:  # pragma: no cover - older typer on click
        from click import get_current_context

    context = get_current_context(silent=True)
    if context is None:
        return message
    for param in context.command.params:
        if getattr(param, "param_type_name", None) != "option" or not param.name:
            continue
        flag = max(param.opts, key=len)
        # a value follows (`name=3`, `name 3`) or, for a snake_case name, the clause ends (`raise ctx_len;`)
        follows = r"=|\s(?=[-\w'\"(\[])|(?=$|[;,.:)])" if "_" in param.name else "="
        message = re.sub(
            rf"(?<![\w-]){param.name}({follows})", lambda m, flag=flag: flag + (" " if m.group(1) else ""), message
        )
    return message


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``Error: message`` (one line, no markup, the command's flags named) on stderr; returns the Exit."""
    console.print(f"[red]Error:[/] {escape(name_flags(message))}")
    return typer.Exit(code)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """A command body's error boundary: a QSpecError is one line on stderr and exit code 1, Ctrl-C exit 130.

    Any other exception is a bug: one line plus a hint to rerun with ``--debug`` for the traceback.
    """
    from qspec.errors import QSpecError

    try:
        yield
    except typer.Exit:
        raise
    except QSpecError as exc:
        if debug_enabled():
            raise
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        console.print("[red]Interrupted.[/]")
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug_enabled():
            raise
        raise fail(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)") from None


@contextlib.contextmanager
def status(title: str) -> Iterator[Callable[[str], None]]:
    """A rich spinner on stderr; yields ``say(message)`` that updates it and logs the phase."""
    import time

    start = time.perf_counter()
    if not console.is_terminal:

        def say(message: str) -> None:
            console.print(f"[dim]{time.perf_counter() - start:6.1f}s[/] {escape(message)}")

        yield say
        return
    with console.status(escape(title)) as spinner:

        def say(message: str) -> None:
            console.print(f"[dim]{time.perf_counter() - start:6.1f}s[/] {escape(message)}")
            spinner.update(escape(message))

        yield say
