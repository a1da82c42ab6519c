"""`python -m fsdp_recipes.cli <command>`: the `fsdp-recipes` console script where it is not installed."""

import sys

from fsdp_recipes.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
