"""Exporter: Hugging Face causal LM -> ONNX graph with the KV cache as explicit retained state."""

from qspec.export.exporter import ExportMeta, ExportOptions, ModelInfo, export_model, read_export

__all__ = ["ExportMeta", "ExportOptions", "ModelInfo", "export_model", "read_export"]
