"""The packages a run measures: compiled from the model through the export cache, or the one package given."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qspec.bench.options import BenchOptions
from qspec.bench.plan import Steps
from qspec.errors import ConfigError


@dataclass(frozen=True)
class ResolvedModel:
    """What ``qspec bench MODEL`` stands for once MODEL is looked at."""

    options: BenchOptions  # narrowed to a given package's batch size and K lists
    given: tuple[str, int, Path] | None  # (weight format, batch size, package) when MODEL is a compiled package
    source: str | None  # the model the baselines load (None: not at hand)
    draft_slots: int | None  # KV slots of the draft package
    notes: tuple[str, ...]


def _is_package(path: Path) -> bool:
    from qspec.package import MANIFEST

    return (path / MANIFEST).is_file()


def _given_package(given: Path, options: BenchOptions) -> tuple[BenchOptions, int, str | None, list[str]]:
    """A compiled package: its batch size and the K lists it holds; the source it was compiled from."""
    from qspec.package import read_manifest

    manifest = read_manifest(given)
    rows = manifest.config.full_batch_size or manifest.config.batch_size
    have = set(manifest.config.num_speculative_tokens)
    if 0 not in have:
        raise ConfigError(
            f"package {given} has no K=0 (it has {sorted(have)}); `none` needs it: recompile with 0 in the K list"
        )
    k_lists = tuple(ks for ks in options.k_lists if set(ks) <= have)
    if not k_lists:
        raise ConfigError(f"none of the K lists {list(options.k_lists)} is compiled in {given} (it has {sorted(have)})")
    notes = []
    dropped = [ks for ks in options.k_lists if ks not in k_lists]
    formats = (manifest.weight_format,)
    if dropped or options.batch_sizes != (rows,) or options.weight_formats != formats:
        notes.append(
            f"a package was given: batch size {rows} only, K lists {[list(k) for k in k_lists]}, "
            f"weight format {manifest.weight_format} only"
        )
    # model_copy skips validation: a given package's format is the run's only one, fp32 or not.
    options = options.model_copy(update={"batch_sizes": (rows,), "k_lists": k_lists, "weight_formats": formats})
    source = manifest.model.source if Path(manifest.model.source).exists() else None
    return options, rows, source, notes


def _given_head_methods(given: Path, options: BenchOptions) -> tuple[BenchOptions, list[str]]:
    """A given package's head runs its method and ``+pld`` (added when no head method was asked for)."""
    from qspec.head_manifest import has_head, read_head_manifest

    if options.draft_head is not None:
        raise ConfigError(
            f"--draft-head {options.draft_head} applies to a model the bench compiles; {given} is compiled: "
            "recompile it with `qspec compile ... --draft-head DIR` or give the model instead"
        )
    asked = options.head_methods
    if not has_head(given):
        if asked:
            raise ConfigError(
                f"methods {list(asked)} need a draft head and {given} has none; recompile it with "
                "`qspec compile ... --draft-head DIR` or drop them from --methods"
            )
        return options, []
    method = read_head_manifest(given).method
    wrong = [m for m in asked if m.removesuffix("+pld") != method]
    if wrong:
        raise ConfigError(f"{given}'s draft head is {method}: methods {wrong} cannot run; use {method}, {method}+pld")
    if asked:
        return options, []
    methods = (*options.methods, method, f"{method}+pld")
    note = f"the package holds a {method} head: {method} and {method}+pld run beside {', '.join(options.methods)}"
    return options.model_copy(update={"methods": methods}), [note]


def _check_draft_head(options: BenchOptions) -> None:
    """Head methods need ``--draft-head`` (a model the bench compiles), and the head's own method."""
    asked = options.head_methods
    if asked and options.draft_head is None:
        raise ConfigError(
            f"methods {list(asked)} need --draft-head HEAD_DIR (a head checkpoint the bench compiles into its packages)"
        )
    if options.draft_head is None:
        return
    from qspec.bench.options import methods_of_head

    method, _ = methods_of_head(options.draft_head)
    wrong = [m for m in asked if m.removesuffix("+pld") != method]
    if wrong:
        raise ConfigError(
            f"the draft head {options.draft_head} is {method}: methods {wrong} cannot run; use {method}, {method}+pld"
        )


def _check_baselines(source: str | None) -> None:
    if source is None:
        raise ConfigError(
            "the transformers baselines need the model the package was compiled from, which is not at hand; "
            "pass --no-baselines or give the model instead of the package"
        )
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        raise ConfigError(
            "the transformers baselines need torch and transformers (pip install 'qspec[export]'); "
            "or pass --no-baselines"
        )


def _draft_slots(options: BenchOptions) -> tuple[int | None, list[str]]:
    if options.draft_package is None:
        return None, []
    from qspec.package import read_manifest

    draft = read_manifest(options.draft_package).config
    slots = draft.full_batch_size or draft.batch_size
    skipped = [b for b in options.batch_sizes if b > slots]
    if not skipped:
        return slots, []
    return slots, [f"draft runs at batch sizes <= {slots} only (the draft package's KV slots), not at {skipped}"]


def resolve_model(model: str, options: BenchOptions) -> ResolvedModel:
    """Look at ``model`` (a package, or what the exporter reads) before any work; clear errors first."""
    given = Path(model)
    notes: list[str] = []
    packages = None
    if given.is_dir() and _is_package(given):
        options, rows, source, notes = _given_package(given, options)
        options, head_notes = _given_head_methods(given, options)
        notes += head_notes
        packages = (options.primary_format, rows, given)
    else:
        from qspec.export.loader import resolve_source

        resolve_source(model)  # a clear error for a path that is no model
        _check_draft_head(options)
        source = model
    if options.baselines:
        _check_baselines(source)
    draft_slots, draft_notes = _draft_slots(options)
    return ResolvedModel(options, packages, source, draft_slots, tuple(notes + draft_notes))


def package_name(
    model: str,
    batch: int,
    ks: Sequence[int],
    options: BenchOptions,
    weight_format: str = "fp32",
) -> str:
    """``smollm2-b1-k0_4-ctx1024-p32``, ``smollm2-int4-b1-...``: what a bench package is cached as; with
    ``options.draft_head`` ``...-head<digest>``, so a head-less package and packages with different heads
    never share a folder."""
    stem = Path(str(model).rstrip("/")).name.removesuffix(".gguf")
    weights = f"-{weight_format}" if weight_format != "fp32" else ""
    name = f"{stem}{weights}-b{batch}-k{'_'.join(map(str, ks))}-ctx{options.ctx_len}-p{options.prefill_seq_len}"
    for tag, buckets in (("cp", options.comp_ctx_lengths_prefill), ("cd", options.comp_ctx_lengths_decode)):
        name += f"-{tag}{buckets.replace(',', '_')}" if buckets else ""
    if options.draft_head is not None:
        from qspec.heads.package import head_digest

        name += f"-head{head_digest(options.draft_head)[:12]}"
    return name


def compile_for(
    model: str,
    batch: int,
    ks: Sequence[int],
    options: BenchOptions,
    root: Path,
    weight_format: str = "fp32",
) -> Path:
    """A package for ``batch`` with ``ks`` (continuous batching above batch 1), reused when unchanged, with
    ``options.draft_head`` compiled in (the K=0 package of the memory comparison too: its graph then has
    the same ``hidden_states`` output, only the specializations differ)."""
    from qspec.compile import CompileOptions, compile_package
    from qspec.specializations import make_config

    spec = make_config(
        num_speculative_tokens=list(ks),
        ctx_len=options.ctx_len,
        prefill_seq_len=options.prefill_seq_len,
        full_batch_size=batch if batch > 1 else None,
        comp_ctx_lengths_prefill=options.comp_ctx_lengths_prefill or None,
        comp_ctx_lengths_decode=options.comp_ctx_lengths_decode or None,
    )
    output = root / package_name(model, batch, ks, options, weight_format)
    head = str(options.draft_head) if options.draft_head is not None else None
    # The bucketed fp32 package also ships model.onnx: the bench times the vendor graph's buckets on it (its
    # weights are the runtime graph's, stored once).
    vendor = weight_format == "fp32" and bool(options.comp_ctx_lengths_decode)
    compile_options = CompileOptions.create(
        specialization=spec, weight_format=weight_format, draft_head=head, vendor_graph=vendor
    )
    folder, _, _ = compile_package(model, compile_options, output=output)
    return folder


@dataclass(frozen=True)
class Packages:
    """The packages a run loads: one per (weight format, max batch size), each with every K (plus 0)."""

    by_format: dict[str, dict[int, Path]]  # weight format -> max batch size -> package; primary format first
    one_spec: Path | None  # K=0 only, for the memory comparison (None: memory off, or a package was given)

    @property
    def flat(self) -> dict[tuple[str, int], Path]:
        """(weight format, max batch size) -> package, in the order they were compiled."""
        return {(f, b): path for f, by_batch in self.by_format.items() for b, path in by_batch.items()}

    def labels(self) -> dict[str, str]:
        """For the report: ``1``, ``4`` (primary format) and ``int4@1`` (another format) -> package folder."""
        primary = next(iter(self.by_format), None)
        return {(str(b) if f == primary else f"{f}@{b}"): str(p) for (f, b), p in self.flat.items()}


def package_count(options: BenchOptions) -> int:
    """Packages :func:`compile_packages` compiles: every batch size of the primary format, batch 1 of the others."""
    return len(options.batch_sizes) + len(options.weight_formats) - 1


def compile_packages(model: str, resolved: ResolvedModel, steps: Steps) -> Packages:
    """One package per batch size, one batch-1 package per other weight format (or the one given),
    plus the K=0 package when memory is measured."""
    if resolved.given is not None:
        weight_format, batch, given = resolved.given
        return Packages({weight_format: {batch: given}}, None)
    from qspec.export.exporter import cache_root

    options = resolved.options
    root = options.packages_dir or cache_root() / "bench-packages"
    primary, *others = options.weight_formats
    wanted = [(primary, b) for b in options.batch_sizes] + [(f, 1) for f in others]
    by_format: dict[str, dict[int, Path]] = {}
    for weight_format, batch in wanted:
        steps.say(f"compiling the {weight_format} batch {batch} package (K {list(options.all_ks)})")
        path = compile_for(model, batch, options.all_ks, options, root, weight_format)
        by_format.setdefault(weight_format, {})[batch] = path
        steps.step(f"{weight_format} package for batch {batch} ready")
    one_spec = None
    if options.memory:
        steps.say("compiling the 1-specialization package for the memory comparison")
        one_spec = compile_for(model, 1, (0,), options, root, primary)
        steps.step("1-specialization package ready")
    return Packages(by_format, one_spec)
