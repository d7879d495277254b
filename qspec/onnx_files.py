"""ONNX graphs whose weights are stored once: linked into packages, read and written by file name.

A package's weight files are hard links to the export cache's (:func:`link_or_copy`): the bytes are on
disk once however many packages use them, and each package is still a complete folder that can be moved,
copied or archived on its own. ONNX Runtime reads hard-linked external data; ``onnx`` and ``onnx_ir``
refuse it (their check against a link planted to leak another file), so qspec reads its own graphs with
:func:`load_model`, which keeps their check that every data file is inside the graph's folder.
A graph saved with :func:`save_model` names each data file it reads by its file name alone: it is valid
in a folder that holds those files, as a package does.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qspec.errors import PackageError


def link_or_copy(source: Path, target: Path) -> None:
    """Hard-link ``source`` as ``target``; a copy where the file system cannot (another device, no links)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def load_model(path: Path):
    """``onnx_ir.load(path)`` with every external tensor read from its file by absolute path.

    The weights stay on disk until read. A data file outside the graph's folder is refused.
    """
    import onnx_ir as ir

    model = ir.load(str(path))
    folder = Path(path).parent.resolve()
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor) or not tensor.base_dir:
            continue
        data = Path(tensor.path).resolve()
        if data.parent != folder:
            raise PackageError(f"{path}: weights of {tensor.name} are outside its folder ({tensor.location})")
        value.const_value = ir.ExternalTensor(
            str(data), tensor.offset, tensor.length, tensor.dtype, shape=tensor.shape, name=tensor.name
        )
    return model


def save_model(model, path: Path) -> None:
    """``onnx_ir.save`` with every external tensor named by its data file's name (weights not rewritten)."""
    import onnx_ir as ir

    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            data = Path(tensor.path)
            value.const_value = ir.ExternalTensor(
                data.name,
                tensor.offset,
                tensor.length,
                tensor.dtype,
                shape=tensor.shape,
                name=tensor.name,
                base_dir=data.parent,
            )
    ir.save(model, str(path))
