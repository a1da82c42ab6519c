"""Test probe, loaded by Python at start-up when this folder is on PYTHONPATH (tests/test_grad_accumulation.py).

Counts FSDP2's gradient reduce-scatters in each rank and writes the count to $REDUCE_SCATTER_COUNT_FILE.<rank>
at exit. It wraps `torch.distributed.reduce_scatter_single`, the call FSDP2's reduce path makes.
"""

import atexit
import os

if os.environ.get("REDUCE_SCATTER_COUNT_FILE"):
    import torch.distributed as dist

    _calls = [0]
    _original = dist.reduce_scatter_single

    def _counting(*args, **kwargs):
        _calls[0] += 1
        return _original(*args, **kwargs)

    dist.reduce_scatter_single = _counting

    def _dump():
        if "RANK" in os.environ:
            with open(f"{os.environ['REDUCE_SCATTER_COUNT_FILE']}.{os.environ['RANK']}", "w") as f:
                f.write(str(_calls[0]))

    atexit.register(_dump)
