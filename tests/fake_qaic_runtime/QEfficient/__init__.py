"""Stand-in for QEfficient (tests only): just the QAIC inference session, see generation/cloud_infer.py."""
