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

The wrapper stays the one place that defines the computation: ``KVExplicitLM.forward`` chains the
same three methods, and the parity tests compare the chained graph with the PyTorch model. Weights
are written once each (a tied LM head shares the embedding's initializer), straight from the torch
tensors to the external data file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from qspec import contract

DOMAIN = "qspec.export"
Progress = Callable[[str], None]

# Names of the values the pieces hand each other (function parameters).
SHARED = ("cos", "sin", "query_pos", "anchor", "valid")  # prologue outputs every layer reads
LAYER_IN = ("hidden", *SHARED)
LAYER_OUT = ("hidden_out", "keys", "values")


class _Prologue(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids):
        return self.lm.prologue(input_ids, position_ids)


class _Layer(nn.Module):
    def __init__(self, lm: nn.Module, index: int):
        super().__init__()
        self.lm = lm
        self.index = index

    def forward(self, hidden, cos, sin, query_pos, anchor, valid, *rest):
        batch_index = rest[0] if self.lm.continuous_batching else None
        return self.lm.layer_step(self.index, hidden, cos, sin, query_pos, anchor, valid, batch_index, *rest[-2:])


class _Epilogue(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, hidden, valid, *rest):
        return self.lm.epilogue(hidden, valid, rest[0] if self.lm.speculative else None)


@dataclass
class Piece:
    """One traced piece as an ONNX function: activations first, then one parameter per weight."""

    function: object  # onnx_ir.Function
    activations: list[str]
    weights: list[torch.Tensor]  # the traced module's tensors, in parameter order
    seconds: float = 0.0


@dataclass
class TraceTimes:
    """Seconds per phase, for ``export.json``."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 2)


def _dims(options) -> dict[str, object]:
    from torch.export import Dim

    batch = Dim(contract.BATCH_SIZE, min=1)
    return {
        "batch": batch,
        "seq": Dim(contract.SEQ_LEN, min=1),
        "ctx": Dim(contract.CTX_LEN, min=2),
        "rows": Dim(contract.FULL_BATCH_SIZE, min=1) if options.continuous_batching else batch,
        "keep": Dim(contract.NUM_LOGITS_TO_KEEP, min=1),
    }


def _examples(lm: nn.Module, info, options):
    """Example tensors of every piece's inputs; sizes are distinct so no dimension specializes."""
    batch, seq, ctx, keep, full_batch = 2, 3, 16, 2, 3
    rows = full_batch if options.continuous_batching else batch
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    pos = torch.arange(seq).repeat(batch, 1)
    with torch.no_grad():
        shared = lm.prologue(ids, pos)
    kv = torch.zeros(rows, info.num_kv_heads, ctx, info.head_dim)
    return {
        "ids": ids,
        "pos": pos,
        "shared": shared,
        "batch_index": torch.tensor([[2], [0]], dtype=torch.int64),
        "keep": torch.zeros(keep, 1, dtype=torch.int64),
        "kv": kv,
    }


def _trace(module: nn.Module, args: tuple, shapes: tuple, inputs: Sequence[str], outputs: Sequence[str]):
    """``torch.onnx.export`` (dynamo, no whole-graph optimizer) of one small piece; returns its ir.Model."""
    from qspec.export.exporter import OPSET

    program = torch.onnx.export(
        module,
        args,
        input_names=list(inputs),
        output_names=list(outputs),
        dynamic_shapes=shapes,
        dynamo=True,
        opset_version=OPSET,
        optimize=False,
        verbose=False,
    )
    return program.model


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` under every name it has (tied weights included)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _to_function(model, name: str, module: nn.Module) -> Piece:
    """Turn a traced piece into a function: its initializers become trailing parameters.

    Weights become parameters before the piece is optimized, so the optimizer folds nothing of
    theirs into a layer-specific constant; the constants it makes become parameters too (functions
    hold no initializers) and are passed the same value by every call.
    """
    import onnx_ir as ir
    import onnxscript.optimizer

    graph = model.graph
    activations = [v.name for v in graph.inputs]
    tensors = _named_tensors(module)
    weights = _initializers_to_inputs(graph, tensors)
    onnxscript.optimizer.optimize(model, num_iterations=1)
    weights += _initializers_to_inputs(graph, tensors)
    function = ir.Function(DOMAIN, name, graph=graph, attributes=[])
    return Piece(function, activations, weights)


def _initializers_to_inputs(graph, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Move every initializer of ``graph`` to its inputs; returns the tensor each one holds."""
    moved = []
    for value in list(graph.initializers.values()):
        tensor = tensors.get(value.name)
        if tensor is None:  # a constant the exporter or optimizer made, not a weight
            tensor = torch.from_numpy(value.const_value.numpy().copy())
        graph.initializers.pop(value.name)
        value.const_value = None
        graph.inputs.append(value)
        moved.append(tensor)
    return moved


def trace_pieces(lm: nn.Module, info, options, times: TraceTimes, say: Progress) -> dict[str, Piece]:
    """Trace the prologue, one layer per distinct signature, and the epilogue; returns them by name."""
    dims = _dims(options)
    ex = _examples(lm, info, options)
    b, s = dims["batch"], dims["seq"]
    shared_shapes = ({0: b, 2: s}, {0: b, 2: s}, {0: b, 1: s}, {0: b}, {0: b, 1: s})  # cos sin qpos anchor valid
    kv_shape = {0: dims["rows"], 2: dims["ctx"]}
    pieces: dict[str, Piece] = {}

    def traced(name: str, module, args, shapes, inputs, outputs) -> None:
        say(f"tracing {name}")
        begin = time.perf_counter()
        model = _trace(module, args, shapes, inputs, outputs)
        pieces[name] = _to_function(model, name, module)
        pieces[name].seconds = time.perf_counter() - begin
        times.add("trace", pieces[name].seconds)

    traced(
        "prologue",
        _Prologue(lm),
        (ex["ids"], ex["pos"]),
        ({0: b, 1: s}, {0: b, 1: s}),
        (contract.INPUT_IDS, contract.POSITION_IDS),
        ("hidden", *SHARED),
    )
    hidden, *shared = ex["shared"]
    extra, extra_shapes, extra_names = [], [], []
    if options.continuous_batching:
        extra, extra_shapes, extra_names = [ex["batch_index"]], [{0: b}], [contract.BATCH_INDEX]
    for index in representative_layers(lm):
        traced(
            layer_function_name(lm, index),
            _Layer(lm, index),
            (hidden, *shared, *extra, ex["kv"], ex["kv"].clone()),
            ({0: b, 1: s}, *shared_shapes, tuple([*extra_shapes, kv_shape, kv_shape])),
            (*LAYER_IN, *extra_names, "past_key", "past_value"),
            LAYER_OUT,
        )
    keep, keep_shape, keep_name = ([ex["keep"]], [{0: dims["keep"]}], [contract.NUM_LOGITS_TO_KEEP]) if options.speculative else ([], [], [])
    traced(
        "epilogue",
        _Epilogue(lm),
        (hidden, shared[-1], *keep),
        ({0: b, 1: s}, {0: b, 1: s}, *([tuple(keep_shape)] if keep else [])),
        ("hidden", "valid", *keep_name),
        (contract.LOGITS,),
    )
    return pieces


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


def compose(lm: nn.Module, pieces: dict[str, Piece], options):
    """The main graph: prologue, every layer with its own weights and KV buffers, epilogue; inlined."""
    import onnx_ir as ir
    from onnx_ir.passes.common import InlinePass, RemoveUnusedFunctionsPass, RemoveUnusedOpsetsPass

    from qspec.export.exporter import OPSET

    names = {id(t): n for n, t in lm.model.named_parameters()} | {id(t): n for n, t in lm.model.named_buffers()}
    initializers: dict[int, ir.Value] = {}

    def weight(tensor: torch.Tensor, fallback: str) -> ir.Value:
        key = id(tensor)
        if key not in initializers:
            name = names.get(key, fallback)
            data = ir.tensor_adapters.TorchTensor(tensor.detach().contiguous(), name=name)
            initializers[key] = ir.Value(name=name, shape=data.shape, type=ir.TensorType(data.dtype), const_value=data)
        return initializers[key]

    def graph_input(piece: Piece, name: str, rename: str | None = None) -> ir.Value:
        src = next(v for v in piece.function.graph.inputs if v.name == name)
        return ir.Value(name=rename or name, shape=src.shape, type=src.type)

    prologue, epilogue = pieces["prologue"], pieces["epilogue"]
    inputs = [graph_input(prologue, contract.INPUT_IDS), graph_input(prologue, contract.POSITION_IDS)]
    first_layer = pieces[layer_function_name(lm, 0)]
    batch_index = keep = None
    if options.continuous_batching:
        batch_index = graph_input(first_layer, contract.BATCH_INDEX)
        inputs.append(batch_index)
    if options.speculative:
        keep = graph_input(epilogue, contract.NUM_LOGITS_TO_KEEP)
        inputs.append(keep)

    nodes, retained = [], []
    pro = ir.node(
        "prologue",
        [*inputs[:2], *(weight(t, f"prologue.{i}") for i, t in enumerate(prologue.weights))],
        domain=DOMAIN,
        num_outputs=1 + len(SHARED),
    )
    nodes.append(pro)
    hidden, *shared = pro.outputs
    reps = representative_layers(lm)
    for i in range(lm.num_layers):
        rep = max(r for r in reps if lm.layer_signature(r) == lm.layer_signature(i))
        piece = pieces[layer_function_name(lm, rep)]
        past = [graph_input(piece, "past_key", contract.past_key(i)), graph_input(piece, "past_value", contract.past_value(i))]
        inputs.extend(past)
        tensors = _layer_weights(lm, piece, rep, i)
        call = ir.node(
            layer_function_name(lm, rep),
            [hidden, *shared, *([batch_index] if batch_index is not None else []), *past,
             *(weight(t, f"layers.{i}.{j}") for j, t in enumerate(tensors))],
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
        [hidden, shared[-1], *([keep] if keep is not None else []),
         *(weight(t, f"epilogue.{i}") for i, t in enumerate(epilogue.weights))],
        domain=DOMAIN,
        num_outputs=1,
    )
    nodes.append(epi)
    logits = epi.outputs[0]
    src = epilogue.function.graph.outputs[0]
    logits.name, logits.shape, logits.type = contract.LOGITS, src.shape, src.type

    graph = ir.Graph(
        inputs,
        [logits, *retained],
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
    return model


def save(model, path: Path) -> None:
    """Write the graph and its weights (external data ``<path>.data``)."""
    import onnx_ir as ir

    ir.save(model, path, external_data=path.name + ".data")
