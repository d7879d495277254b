"""``qspec train-head``: a thin Typer layer over :func:`qspec.heads.distill.distill_head`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from qspec_cli.common import cli_errors, console


def train_head(
    package: Annotated[
        Path, typer.Argument(metavar="PACKAGE", help="Package compiled with --hidden-states (the head serves it).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the head (EAGLE-1 or Medusa layout).")],
    method: Annotated[
        str,
        typer.Option(help="eagle (one decoder layer, chained), eagle3 (three taps, training-time test) or medusa."),
    ] = "eagle",
    data: Annotated[
        Optional[Path],
        typer.Option(help='JSON lines of prompts ({"messages": [...]} or {"prompt": ...}); default: chit-chat.'),
    ] = None,
    prompts: Annotated[
        int, typer.Option(help="Chit-chat prompts the package answers (its greedy output is the data).")
    ] = 1500,
    instructions: Annotated[
        int, typer.Option(help="Instructions of eight kinds (writing, coding, math, ...) the package answers.")
    ] = 0,
    code: Annotated[int, typer.Option(help="Standard-library functions teacher-forced as answers.")] = 0,
    dialogues: Annotated[int, typer.Option(help="Chit-chat dialogues teacher-forced through the package.")] = 500,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens of each generated answer, at most.")] = 128,
    answer_with: Annotated[
        str,
        typer.Option(help="package (its exact greedy text, one slot) or source (the model it came from, batched)."),
    ] = "package",
    features_from: Annotated[
        str,
        typer.Option(
            help="package (its hidden states of the answers, a second pass) or source (the source model's, read "
            "off the forwards that write them; needs --answer-with source)."
        ),
    ] = "package",
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = 4,
    draft_vocab: Annotated[int, typer.Option(help="Draft vocabulary: the most frequent greedy tokens.")] = 8192,
    medusa_heads: Annotated[int, typer.Option(help="medusa: heads (drafts per call).")] = 3,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, warm-up then cosine).")] = 1e-3,
    seed: Annotated[int, typer.Option(help="Seed of prompts, split, order and initialisation.")] = 0,
    target: Annotated[
        Optional[str],
        typer.Option("--target", "--model", help="The model the package was compiled from (default: its manifest's)."),
    ] = None,
    magpie: Annotated[
        Optional[int],
        typer.Option(help="Requests the model writes itself (Magpie), answered (default: eagle3 1200, else 0)."),
    ] = None,
    eval_mt_bench: Annotated[
        int, typer.Option(help="MT-bench first turns answered for the learning curve only (never trained on).")
    ] = 16,
    ttt_steps: Annotated[int, typer.Option(help="eagle3: unroll steps of the training-time test.")] = 4,
    parallel: Annotated[
        int, typer.Option(help="eagle: also draft this many tokens in one head call (mask pairs); 0: chained only.")
    ] = 0,
    init_head: Annotated[
        Optional[Path], typer.Option(help="eagle: start from this EAGLE-1 head (its weights and draft vocabulary).")
    ] = None,
    taps: Annotated[
        Optional[str], typer.Option(help="eagle3: three layer ids, e.g. 2,15,27 (default 2,L/2,L-3).")
    ] = None,
    work_dir: Annotated[
        Optional[Path], typer.Option(help="Answers and features (resumable); default OUTPUT/../.OUTPUT-work.")
    ] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads for training (default: all cores).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the training log as JSON.")] = False,
) -> None:
    """Self-distill a draft head (EAGLE or Medusa) from PACKAGE's own hidden states and greedy answers.

    The defaults take hours on a 2-core machine (the shipped head's `make head` about two). Quick: --prompts
    64 --dialogues 0 --epochs 1 --draft-vocab 1024 runs the whole path to a head that drafts, not one that
    pays (53 minutes measured for SmolLM2-135M int4 on a 2-core VM shared with other jobs; less when idle).
    """

    with cli_errors():
        if method == "eagle3":
            from qspec_cli.heads3 import train_eagle3

            return train_eagle3(
                package,
                output,
                work_dir,
                target,
                threads,
                as_json,
                data=dict(
                    magpie=1200 if magpie is None else magpie,
                    eval_mt_bench=eval_mt_bench,
                    prompts=prompts,
                    instructions=instructions,
                    dialogues=dialogues,
                    max_new_tokens=max_new_tokens,
                    taps=tuple(int(t) for t in taps.split(",")) if taps else None,
                    seed=seed,
                ),
                train=dict(steps=ttt_steps, draft_vocab=draft_vocab, epochs=epochs, lr=lr, seed=seed),
            )
        from qspec.heads.distill import DistillOptions, distill_head
        from qspec.heads.train import TrainOptions

        options = TrainOptions.create(
            method=method,
            draft_vocab=draft_vocab,
            epochs=epochs,
            lr=lr,
            medusa_heads=medusa_heads,
            seed=seed,
            threads=threads,
            parallel=parallel,
            init_head=init_head,
        )
        distill = DistillOptions.create(
            prompts=prompts,
            instructions=instructions,
            code=code,
            dialogues=dialogues,
            answer_with=answer_with,
            features_from=features_from,
            prompts_file=data,
            max_new_tokens=max_new_tokens,
            magpie=magpie or 0,
            eval_mt_bench=eval_mt_bench,
            seed=seed,
        )
        work = work_dir or output.parent / f".{output.name}-work"
        log = distill_head(
            package,
            output,
            work_dir=work,
            data=distill,
            train=options,
            target=target,
            progress=lambda message: console.print(message, markup=False),
        )
        if as_json:
            print(json.dumps(log, indent=2))
            return
        last = log["epochs"][-1]
        mt_bench = last.get("chain_accuracy", {}).get("mt_bench")
        print(
            f"wrote {output} ({method}, draft vocabulary {log['draft_vocab']}, {log['train_positions']} training "
            f"positions): held-out chain accuracy {last['held_out_chain_accuracy']}"
            + (f", MT-bench {mt_bench}" if mt_bench else "")
        )
