"""Stand-in for QEfficient.generation (tests only)."""
