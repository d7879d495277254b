"""``qspec train-head --method eagle3``: the EAGLE-3 branch of :mod:`qspec_cli.heads`."""

from __future__ import annotations

import json
from pathlib import Path

from qspec_cli.common import console


def train_eagle3(
    package: Path,
    output: Path,
    work_dir: Path | None,
    model: str | None,
    threads: int | None,
    as_json: bool,
    *,
    data: dict,
    train: dict,
) -> None:
    from qspec.heads.eagle3_distill import Eagle3DataOptions, distill_eagle3
    from qspec.heads.eagle3_train import Eagle3Options

    log = distill_eagle3(
        package,
        output,
        work_dir=work_dir or output.parent / f".{output.name}-work",
        data=Eagle3DataOptions.create(**data),
        train=Eagle3Options.create(**train),
        model=model,
        threads=threads,
        progress=lambda message: console.print(message, markup=False),
    )
    if as_json:
        print(json.dumps(log, indent=2))
        return
    last = log["curve"][-1]
    measured = ", ".join(f"{name} {last[name]['chain']}" for name in ("held_out", "mt_bench") if name in last)
    print(f"wrote {output} (eagle3, draft vocabulary {log['draft_vocab']}): chain acceptance per depth {measured}")
