"""Trace the KV-explicit wrapper piece by piece and chain the pieces into one ONNX graph.

Tracing a 30-layer model whole costs minutes (``torch.export``, decompositions, translation and the
optimizer all grow with the node count), yet every decoder layer is the same computation with other
weights. So the exporter traces :meth:`KVExplicitLM.prologue`, :meth:`~KVExplicitLM.layer_step` once
per distinct layer signature, and :meth:`~KVExplicitLM.epilogue`, each as a small graph whose weights
are inputs, turns each into an ONNX function, writes a main graph that calls them in order with each
layer's own weights, and lets onnx-ir's ``InlinePass`` inline the calls::

    input_ids, position_ids ─► prologue ─► hidden, cos, sin, query_pos, anchor, valid
    hidden ─► layer(sig of 0)(…, past_key.0, past_value.0, weights of layer 0) ─► hidden, *_RetainedState
      …     ─► layer(sig of N-1)(…)                                            ─► hidden, *_RetainedState
    hidden, valid, num_logits_to_keep ─► epilogue(norm, lm_head) ─► logits
    (with ``taps``: the hidden entering each tapped layer is also a graph output, ``tap.{i}``)

The KV write and read of every layer stay calls of QEfficient's ``CtxScatter`` / ``CtxGather`` functions
through all of this (the tracer emits a node per call, the inlining passes know no body of theirs);
:func:`compose` adds their definitions last (:mod:`qspec.export.ctx_functions`).

The wrapper stays the one place that defines the computation: ``KVExplicitLM.forward`` chains the
same three methods, and the parity tests compare the chained graph with the PyTorch model. Weights
are written once each (a tied LM head shares the embedding's initializer), straight from the torch
tensors to the external data file, or, streamed (:mod:`qspec.export.checkpoint`), read one by one from
the checkpoint as they are written: then only the traced layers ever have storage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from qspec import contract
from qspec.export.graph import OPSET, expected_dims, tap_layers, tap_name

DOMAIN = "qspec.export"
Progress = Callable[[str], None]

# Names of the values the pieces hand each other (function parameters).
SHARED = ("cos", "sin", "query_pos", "anchor", "valid")  # prologue outputs every layer reads
LAYER_IN = ("hidden", *SHARED)
LAYER_OUT = ("hidden_out", "keys", "values")


@dataclass
class PieceSpec:
    """One piece to trace: its example inputs (distinct sizes and dims of its own) and output names."""

    name: str
    run: Callable[..., tuple]
    inputs: list[str]
    examples: list[torch.Tensor]
    shapes: list[dict]
    outputs: list[str]


class _SideBySide(nn.Module):
    """Every piece on inputs of its own, so one ``torch.onnx.export`` call traces them all."""

    def __init__(self, lm: nn.Module, specs: list[PieceSpec]):
        super().__init__()
        self.lm = lm
        self.specs = specs

    def forward(self, *args):
        outputs, at = [], 0
        for spec in self.specs:
            result = spec.run(*args[at : at + len(spec.inputs)])
            outputs.extend(result if isinstance(result, tuple) else (result,))
            at += len(spec.inputs)
        return tuple(outputs)


@dataclass
class Piece:
    """One traced piece as an ONNX function: activations first, then one parameter per weight."""

    function: object  # onnx_ir.Function
    weights: list[torch.Tensor]  # the traced module's tensors, in parameter order


@dataclass
class TraceTimes:
    """Seconds per phase, for ``export.json``."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 2)


def piece_specs(lm: nn.Module, info, options) -> list[PieceSpec]:
    """Prologue, one layer per distinct signature, epilogue.

    Each piece gets example sizes and symbolic dimensions of its own, so the tracer relates nothing
    across pieces and each piece's graph depends on its own inputs only.
    """
    from torch.export import Dim

    def dims(tag: str, batch: int, seq: int):
        return Dim(f"batch_{tag}", min=1), Dim(f"seq_{tag}", min=1), torch.zeros(batch, seq, dtype=torch.int64)

    specs = []
    b, s, ids = dims("prologue", 2, 3)
    specs.append(
        PieceSpec(
            "prologue",
            lm.prologue,
            [contract.INPUT_IDS, contract.POSITION_IDS],
            [ids, torch.arange(3).repeat(2, 1)],
            [{0: b, 1: s}, {0: b, 1: s}],
            ["hidden", *SHARED],
        )
    )
    for j, index in enumerate(representative_layers(lm)):
        batch, seq, ctx, rows = 4 + 2 * j, 5 + 2 * j, 19 + 2 * j, 11 + 2 * j
        b, s, ids = dims(f"layer{j}", batch, seq)
        with torch.no_grad():
            hidden, *shared = lm.prologue(ids, torch.arange(seq).repeat(batch, 1))
        rows_dim = Dim(f"rows_layer{j}", min=1) if options.continuous_batching else b
        kv_rows = rows if options.continuous_batching else batch
        key, value = (torch.zeros(kv_rows, info.num_kv_heads, ctx, width) for width in info.kv_widths()[:2])
        kv_shape = {0: rows_dim, 2: Dim(f"ctx_layer{j}", min=2)}
        names, examples = [*LAYER_IN], [hidden, *shared]
        shapes = [{0: b, 1: s}, {0: b, 2: s}, {0: b, 2: s}, {0: b, 1: s}, {0: b}, {0: b, 1: s}]
        if options.continuous_batching:
            names.append(contract.BATCH_INDEX)
            examples.append(torch.arange(batch, dtype=torch.int64)[:, None] * 2 % rows)
            shapes.append({0: b})
        names += ["past_key", "past_value"]
        examples += [key, value]
        shapes += [kv_shape, kv_shape]
        if options.comp_ctx_lengths:
            names.append(contract.COMP_CTX_LENGTHS)
            examples.append(torch.zeros(ctx - 3, dtype=torch.int64))  # attend fewer slots than the buffer
            shapes.append({0: Dim(f"ccl_layer{j}", min=1)})
        if options.tree_inputs:  # a chain's: written at its positions, each token seeing those before it
            names += list(contract.TREE_INPUTS)
            examples += [
                torch.arange(seq).repeat(batch, 1),
                torch.ones(seq, seq, dtype=torch.bool).tril().repeat(batch, 1, 1),
                torch.zeros(batch, seq, 2, dtype=torch.int64),
            ]
            shapes += [{0: b, 1: s}, {0: b, 1: s, 2: s}, {0: b, 1: s}]
        specs.append(
            PieceSpec(
                layer_function_name(lm, index),
                _layer_call(lm, index, options),
                names,
                examples,
                shapes,
                list(LAYER_OUT),
            )
        )
    b, s, ids = dims("epilogue", 6, 7)
    names, examples, shapes = (
        ["hidden", "valid"],
        [torch.zeros(6, 7, lm.config.hidden_size), ids >= 0],
        [{0: b, 1: s}, {0: b, 1: s}],
    )
    if options.speculative:
        names.append(contract.NUM_LOGITS_TO_KEEP)
        examples.append(torch.zeros(2, 1, dtype=torch.int64))
        shapes.append({0: Dim("keep_epilogue", min=1)})
    run = lm.epilogue if options.speculative else (lambda hidden, valid: lm.epilogue(hidden, valid, None))
    outputs = [contract.LOGITS] + ([contract.HIDDEN_STATES] if options.hidden_states else [])
    specs.append(PieceSpec("epilogue", run, names, examples, shapes, outputs))
    return specs


def _layer_call(lm: nn.Module, index: int, options) -> Callable[..., tuple]:
    def call(hidden, cos, sin, query_pos, anchor, valid, *rest):
        rest = list(rest)
        batch_index = rest.pop(0) if options.continuous_batching else None
        tree = tuple(rest[-3:]) if options.tree_inputs else None
        rest = rest[:-3] if options.tree_inputs else rest
        ccl = rest.pop() if options.comp_ctx_lengths else None
        return lm.layer_step(index, hidden, cos, sin, query_pos, anchor, valid, batch_index, *rest, ccl, tree=tree)

    return call


def trace_pieces(lm: nn.Module, info, options, times: TraceTimes, say: Progress) -> dict[str, Piece]:
    """Trace every piece in one export call, then cut the graph into one function per piece."""
    import onnxscript.optimizer

    from qspec.export import ctx_functions

    specs = piece_specs(lm, info, options)
    module = _SideBySide(lm, specs)
    say(f"tracing {', '.join(spec.name for spec in specs)}")
    begin = time.perf_counter()
    program = torch.onnx.export(
        module,
        tuple(t for spec in specs for t in spec.examples),
        input_names=[f"{spec.name}/{name}" for spec in specs for name in spec.inputs],
        output_names=[f"{spec.name}/{name}" for spec in specs for name in spec.outputs],
        dynamic_shapes=(tuple(shape for spec in specs for shape in spec.shapes),),  # forward(*args)
        dynamo=True,
        opset_version=OPSET,
        optimize=False,
        verbose=False,
        custom_translation_table=ctx_functions.translation_table(),  # the KV write and read: one node each
    )
    times.add("trace", time.perf_counter() - begin)
    say("optimizing the traced pieces")
    begin = time.perf_counter()
    model = program.model
    tensors = _named_tensors(module)
    weights = _initializers_to_inputs(model.graph, tensors)
    # weights are inputs: nothing of theirs is folded; the Ctx nodes stay calls (their functions are added last)
    onnxscript.optimizer.optimize(model, num_iterations=1, inline=False)
    weights |= _initializers_to_inputs(model.graph, tensors)
    pieces = {spec.name: _cut(model.graph, spec, weights) for spec in specs}
    times.add("optimize", time.perf_counter() - begin)
    return pieces


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` under every name it has (tied weights included)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _initializers_to_inputs(graph, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Move every initializer of ``graph`` to its inputs; returns ``{input name: tensor it holds}``.

    Weights become inputs before the graph is optimized, so the optimizer folds nothing of theirs
    into a layer-specific constant; the constants the exporter or optimizer make are moved too
    (functions hold no initializers) and every call passes them the same value.
    """
    moved = {}
    for value in list(graph.initializers.values()):
        tensor = tensors.get(value.name)
        if tensor is None:  # a constant the exporter or optimizer made, not a weight
            tensor = torch.from_numpy(value.const_value.numpy().copy())
        graph.initializers.pop(value.name)
        value.const_value = None
        graph.inputs.append(value)
        moved[value.name] = tensor
    return moved


def _cut(graph, spec: PieceSpec, weights: dict[str, torch.Tensor]) -> Piece:
    """The nodes that compute ``spec``'s outputs, as a function of its inputs and the weights they read."""
    import onnx_ir as ir

    outputs = [next(v for v in graph.outputs if v.name == f"{spec.name}/{name}") for name in spec.outputs]
    nodes, seen, stack = [], set(), [v.producer() for v in outputs]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    order = {id(node): i for i, node in enumerate(graph)}
    nodes.sort(key=lambda node: order[id(node)])
    graph.remove(nodes, safe=False)
    activations = [v for v in graph.inputs if v.name.startswith(spec.name + "/")]
    for value in activations:
        graph.inputs.remove(value)
    for value in outputs:
        graph.outputs.remove(value)
    for value in (*activations, *outputs):
        value.name = value.name.removeprefix(spec.name + "/")
    # Weights may be read by several pieces: each piece reads its own parameter of the same name.
    params: dict[str, ir.Value] = {}
    for node in nodes:
        for i, value in enumerate(node.inputs):
            if value is not None and value.name in weights and value.producer() is None:
                if value.name not in params:
                    params[value.name] = ir.Value(name=value.name, shape=value.shape, type=value.type)
                node.replace_input_with(i, params[value.name])
    body = ir.Graph(activations + list(params.values()), outputs, nodes=nodes, opset_imports=dict(graph.opset_imports))
    function = ir.Function(DOMAIN, spec.name, graph=body, attributes=[])
    return Piece(function, [weights[name] for name in params])


def representative_layers(lm: nn.Module) -> list[int]:
    """The first layer of each distinct signature: the only layers that are traced."""
    seen: dict[tuple, int] = {}
    for i in range(lm.num_layers):
        seen.setdefault(lm.layer_signature(i), i)
    return sorted(seen.values())


def layer_function_name(lm: nn.Module, index: int) -> str:
    return f"layer_{representative_layers(lm).index(index)}"


def _layer_weights(lm: nn.Module, piece: Piece, traced: int, target: int) -> list[torch.Tensor]:
    """Layer ``target``'s tensors in the parameter order of the piece traced from layer ``traced``."""
    local = {id(t): name for name, t in _named_tensors(lm.layers[traced]).items()}
    theirs = _named_tensors(lm.layers[target])
    return [theirs[local[id(t)]] if id(t) in local else t for t in piece.weights]


def compose(lm: nn.Module, pieces: dict[str, Piece], options, streamed=None):
    """The main graph: prologue, every layer with its own weights and KV buffers, epilogue; inlined.

    ``streamed``: a :class:`~qspec.export.checkpoint.StreamedWeights`; the weights it holds are read from
    the checkpoint as they are written (the model's own tensors may then be on the meta device).
    """
    import onnx_ir as ir
    from onnx_ir.passes.common import InlinePass, RemoveUnusedFunctionsPass, RemoveUnusedOpsetsPass

    from qspec.export import ctx_functions

    names = {id(t): n for n, t in lm.model.named_parameters()} | {id(t): n for n, t in lm.model.named_buffers()}
    initializers: dict[int, ir.Value] = {}

    def weight(tensor: torch.Tensor, fallback: str) -> ir.Value:
        key = id(tensor)
        if key not in initializers:
            name = names.get(key, fallback)
            if streamed is not None and name in streamed:
                data = streamed.lazy(name, tensor)
            else:
                assert not tensor.is_meta, f"weight {name} has no data: it is neither in the model nor the checkpoint"
                # No copy here: a transposed view is made contiguous one tensor at a time, as it is written.
                data = ir.tensor_adapters.TorchTensor(tensor.detach(), name=name)
            initializers[key] = ir.Value(name=name, shape=data.shape, type=ir.TensorType(data.dtype), const_value=data)
        return initializers[key]

    want = expected_dims(lm.num_layers, options, lm.config.vocab_size, latent=lm.latent)
    kv_names = contract.kv_names(lm.num_layers, latent=lm.latent)

    def graph_input(piece: Piece, name: str, rename: str | None = None) -> ir.Value:
        """A graph input typed like the piece's parameter, its dims named as the contract says."""
        like = next(v for v in piece.function.graph.inputs if v.name == name)
        rename = rename or name
        dims = [w if w is not None else like.shape[i] for i, w in enumerate(want[rename])]
        return ir.Value(name=rename, shape=ir.Shape(dims), type=like.type)

    prologue, epilogue = pieces["prologue"], pieces["epilogue"]
    inputs = [graph_input(prologue, contract.INPUT_IDS), graph_input(prologue, contract.POSITION_IDS)]
    first_layer = pieces[layer_function_name(lm, 0)]
    batch_index = keep = ccl = None
    if options.continuous_batching:
        batch_index = graph_input(first_layer, contract.BATCH_INDEX)
        inputs.append(batch_index)
    if options.speculative:
        keep = graph_input(epilogue, contract.NUM_LOGITS_TO_KEEP)
        inputs.append(keep)
    if options.comp_ctx_lengths:
        ccl = graph_input(first_layer, contract.COMP_CTX_LENGTHS)
        inputs.append(ccl)
    tree = [graph_input(first_layer, name) for name in contract.TREE_INPUTS] if options.tree_inputs else []
    inputs.extend(tree)

    nodes, retained = [], []
    pro = ir.node(
        "prologue",
        [*inputs[:2], *(weight(t, f"prologue.{i}") for i, t in enumerate(prologue.weights))],
        domain=DOMAIN,
        num_outputs=1 + len(SHARED),
    )
    nodes.append(pro)
    hidden, *shared = pro.outputs
    reps = {lm.layer_signature(r): r for r in representative_layers(lm)}
    tap_ids, taps = tap_layers(options.taps, lm.num_layers), []
    for i in range(lm.num_layers):
        if i in tap_ids:  # the residual stream entering layer i
            taps.append((i, hidden))
        rep = reps[lm.layer_signature(i)]
        piece = pieces[layer_function_name(lm, rep)]
        past = [
            graph_input(piece, "past_key", kv_names[2 * i]),
            graph_input(piece, "past_value", kv_names[2 * i + 1]),
        ]
        inputs.extend(past)
        tensors = _layer_weights(lm, piece, rep, i)
        call = ir.node(
            layer_function_name(lm, rep),
            [
                hidden,
                *shared,
                *([batch_index] if batch_index is not None else []),
                *past,
                *([ccl] if ccl is not None else []),
                *tree,
                *(weight(t, f"layers.{i}.{j}") for j, t in enumerate(tensors)),
            ],
            domain=DOMAIN,
            num_outputs=len(LAYER_OUT),
        )
        nodes.append(call)
        hidden, keys, values = call.outputs
        for value, buffer in ((keys, past[0]), (values, past[1])):
            value.name = contract.retained(buffer.name)
            value.shape, value.type = buffer.shape, buffer.type
            retained.append(value)
    epi = ir.node(
        "epilogue",
        [
            hidden,
            shared[-1],
            *([keep] if keep is not None else []),
            *(weight(t, f"epilogue.{i}") for i, t in enumerate(epilogue.weights)),
        ],
        domain=DOMAIN,
        num_outputs=len(epilogue.function.graph.outputs),
    )
    nodes.append(epi)
    outputs = []
    for value, traced in zip(epi.outputs, epilogue.function.graph.outputs):
        value.name, value.type = traced.name.split("/")[-1], traced.type
        value.shape = ir.Shape([w if w is not None else traced.shape[i] for i, w in enumerate(want[value.name])])
        outputs.append(value)
    hidden_type = first_layer.function.graph.outputs[0].type
    for i, value in taps:
        value.name, value.type = tap_name(i), hidden_type
        value.shape = ir.Shape([*want[value.name][:2], lm.config.hidden_size])
        outputs.append(value)

    graph = ir.Graph(
        inputs,
        [*outputs, *retained],
        nodes=nodes,
        initializers=list(initializers.values()),
        opset_imports={"": OPSET, DOMAIN: 1},
        name="qspec",
    )
    functions = {piece.function.identifier(): piece.function for piece in pieces.values()}
    model = ir.Model(graph, ir_version=10, producer_name="qspec", functions=functions.values())
    InlinePass()(model)
    RemoveUnusedFunctionsPass()(model)
    RemoveUnusedOpsetsPass()(model)
    ctx_functions.attach(model)  # after inlining: the Ctx calls stay calls, as QEfficient's graphs have them
    return model


def save(model, path: Path) -> None:
    """Write the graph and its weights (external data ``<path>.data``)."""
    import onnx_ir as ir

    ir.save(model, path, external_data=path.name + ".data")
