"""What every command shares: the error boundary, progress on stderr, prompt files."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import typer
from rich.console import Console

console = Console(stderr=True, highlight=False)


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
        console.print(f"[red]Error:[/] {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", soft_wrap=True)
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


def read_prompts(path: Path) -> list[str]:
    """Prompts of a JSONL file: each line's ``prompt``, ``text`` or first of ``turns``."""
    from qspec.errors import ConfigError

    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); one JSON object per line") from None
        if isinstance(item, str):
            prompts.append(item)
            continue
        value = item.get("prompt") or item.get("text") or (item.get("turns") or [None])[0] if isinstance(item, dict) else None
        if not isinstance(value, str):
            raise ConfigError(f'{path}:{number}: no "prompt", "text" or "turns" string')
        prompts.append(value)
    if not prompts:
        raise ConfigError(f"prompts file {path} has no prompts")
    return prompts
