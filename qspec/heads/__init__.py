"""Draft heads that read the target's hidden states: EAGLE-1 and Medusa (FasterDecoding, QEfficient turbo).

``modules`` holds the torch modules and their checkpoint layouts; ``export`` and ``package`` turn a head
into ONNX graphs with their own specializations inside a compiled package. Everything here needs torch
(the ``export`` extra) except :mod:`qspec.head_manifest`, which the runtime reads.
"""
