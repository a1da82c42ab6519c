"""Test probes, loaded by Python at start-up when this folder is on PYTHONPATH; each is off unless its variable is set.

REDUCE_SCATTER_COUNT_FILE (tests/test_grad_accumulation.py): counts FSDP2's gradient reduce-scatters in each rank
and writes the count to $REDUCE_SCATTER_COUNT_FILE.<rank> at exit. It wraps `torch.distributed.reduce_scatter_single`,
the call FSDP2's reduce path makes.
"""

import atexit
import os

if os.environ.get("FSDP_RECIPES_TEST_FORK_SERVER"):
    # first: a process the fork server serves becomes a stand-in for its fork here, before any hook imports torch
    import fork_server

    fork_server.delegate()

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

if os.environ.get("SLOW_SAVE_S"):
    # SLOW_SAVE_S (tests/test_preemption.py): a checkpoint save slower than the grace period. Every torch.save into
    # checkpoint-N with N > $SLOW_SAVE_AFTER_STEP sleeps $SLOW_SAVE_S seconds once the file is written.
    import re
    import time

    import torch

    _save = torch.save

    def _slow_save(obj, f, *args, **kwargs):
        result = _save(obj, f, *args, **kwargs)
        step = re.search(r"checkpoint-(\d+)", str(f))
        if step and int(step.group(1)) > int(os.environ.get("SLOW_SAVE_AFTER_STEP", "0")):
            time.sleep(float(os.environ["SLOW_SAVE_S"]))
        return result

    torch.save = _slow_save

if os.environ.get("SLOW_CHECK_S") and "LOCAL_RANK" not in os.environ:
    # SLOW_CHECK_S (tests/test_start_gate.py): the launcher's recipe checks take this many seconds longer, so a
    # test can look at the ranks while they wait at the start gate. Only in the launcher, not in the ranks.
    import time

    from fsdp_recipes.train import run_checks

    _parse_and_check = run_checks.parse_and_check

    def _slow_parse_and_check(*args, **kwargs):
        # ... or until the test creates $SLOW_CHECK_RELEASE, once it has seen what it looks for
        release, end = os.environ.get("SLOW_CHECK_RELEASE"), time.time() + float(os.environ["SLOW_CHECK_S"])
        while time.time() < end and not (release and os.path.exists(release)):
            time.sleep(0.05)
        return _parse_and_check(*args, **kwargs)

    run_checks.parse_and_check = _slow_parse_and_check

if os.environ.get("ABORT_AT_EXIT_RANK") and os.environ.get("RANK") == os.environ["ABORT_AT_EXIT_RANK"]:
    # ABORT_AT_EXIT_RANK (tests/test_start_gate.py): that rank dies of SIGABRT when its interpreter exits, after
    # the run has finished, as a teardown crash in a C++ destructor would.
    atexit.register(os.abort)

if os.environ.get("NAN_LOSS_AT_STEP") and "LOCAL_RANK" in os.environ:
    # NAN_LOSS_AT_STEP (tests/test_mistakes.py): the loss of that optimizer step is NaN on every rank, as a
    # diverging run's would be.
    from trl import SFTTrainer

    _compute_loss = SFTTrainer.compute_loss

    def _nan_loss(self, *args, **kwargs):
        result = _compute_loss(self, *args, **kwargs)
        if self.state.global_step + 1 == int(os.environ["NAN_LOSS_AT_STEP"]):
            if isinstance(result, tuple):
                return (result[0] * float("nan"), *result[1:])
            return result * float("nan")
        return result

    SFTTrainer.compute_loss = _nan_loss

if os.environ.get("SAFETENSORS_READ_FILE") and "RANK" in os.environ:
    # SAFETENSORS_READ_FILE, SAFETENSORS_READ_DIR (tests/test_default_recipe.py): the bytes of tensors each rank
    # materialises from safetensors files in $SAFETENSORS_READ_DIR (the model's folder), written as JSON to
    # $SAFETENSORS_READ_FILE.<rank> at exit. transformers 5 opens each file with `safe_open` and materialises
    # `get_slice(k)[...]`; both paths (and get_tensor) are counted.
    import json

    import safetensors

    _read = {"files": [], "bytes": 0}
    _open = safetensors.safe_open
    _watched = os.path.realpath(os.environ["SAFETENSORS_READ_DIR"])

    def _count(t):
        _read["bytes"] += t.numel() * t.element_size()
        return t

    class _CountedSlice:
        def __init__(self, inner):
            self._inner = inner

        def __getitem__(self, index):
            return _count(self._inner[index])

        def __getattr__(self, name):
            return getattr(self._inner, name)

    class _CountedFile:
        def __init__(self, inner):
            self._inner = inner

        def get_slice(self, key):
            return _CountedSlice(self._inner.get_slice(key))

        def get_tensor(self, key):
            return _count(self._inner.get_tensor(key))

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __enter__(self):
            self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

    def _counting_open(path, *args, **kwargs):
        handle = _open(path, *args, **kwargs)
        if os.path.realpath(os.path.dirname(str(path))) != _watched:
            return handle
        _read["files"].append(os.path.basename(str(path)))
        return _CountedFile(handle)

    safetensors.safe_open = _counting_open

    def _dump_reads():
        with open(f"{os.environ['SAFETENSORS_READ_FILE']}.{os.environ['RANK']}", "w") as f:
            json.dump(_read, f)

    atexit.register(_dump_reads)

if os.environ.get("FAKE_LAUNCH_EXIT") and "fsdp_recipes.launch.launcher" in __import__("sys").orig_argv:
    # FAKE_LAUNCH_EXIT (tests/test_make.py): the launcher ends at once with this exit code, as a UserError with that
    # code ends it (a failed run's one line: 1). Nothing is checked or started.
    from fsdp_recipes.config import recipes as _recipes
    from fsdp_recipes.errors import UserError as _UserError

    def _ended(*args, **kwargs):
        code = int(os.environ["FAKE_LAUNCH_EXIT"])
        raise _UserError(f"the launch ended with exit code {code} (FAKE_LAUNCH_EXIT)", exit_code=code)

    _recipes.load = _ended
