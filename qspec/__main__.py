"""``python -m qspec``: the same command line as ``qspec``."""

from qspec_cli.main import main

if __name__ == "__main__":
    main()
