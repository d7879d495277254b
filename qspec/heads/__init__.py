"""Draft heads that read the target's hidden states: EAGLE-1, EAGLE-3, Medusa (FasterDecoding, QEfficient turbo).

One module per kind (``eagle``, ``eagle3``, ``medusa``), each a :class:`~qspec.heads.kind.HeadKind` listed in
:data:`qspec.heads.kinds.KINDS`; ``export`` and ``package`` turn a head into ONNX graphs with their own
specializations inside a compiled package. Everything here needs torch (the ``export`` extra); what the runtime
reads, :mod:`qspec.head_manifest`, lives beside :mod:`qspec.package`.
"""
