#!/usr/bin/env python
"""The rank entry point (every trainer kind) as a script, for `accelerate launch scripts/train.py --config ...`.

The code lives in the package (fsdp_recipes.train.entry) so recipe folders copied elsewhere can use it too.
"""

from fsdp_recipes.api import exit_without_teardown, train_main

if __name__ == "__main__":
    exit_without_teardown(train_main())
