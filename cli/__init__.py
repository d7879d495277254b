"""qspec command line."""
