"""qspec: ahead-of-time compiler and runtime for multi-specialization speculative decoding."""

__version__ = "0.1.0"
