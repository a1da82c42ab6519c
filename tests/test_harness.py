"""The test harness itself: no process a test starts outlives it, even one that left its parent's session."""

import subprocess
import time

import psutil

from conftest import kill_test_processes, tagged_processes


def test_a_detached_grandchild_is_found_and_killed():
    # bash starts `sleep` in a session of its own and exits at once, as the launcher does with accelerate: the
    # sleep is then nobody's child and in no process group of ours
    subprocess.run(["bash", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null &"], check=True)
    deadline = time.time() + 10
    while not (found := [p for p in tagged_processes() if p.name() == "sleep"]) and time.time() < deadline:
        time.sleep(0.05)
    assert found, "the detached sleep should carry the test tag"
    assert any("sleep 300" in cmd for cmd in kill_test_processes())
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in found)


def test_the_fork_server_has_imported_the_launchers_libraries():
    """tests/forked_launcher.py: a fork of the server finds TRL's configs, PEFT, datasets and the launcher imported
    (a preload that fails is silent in multiprocessing: Python 3.11's server once ignored the tests' sys.path)."""
    import forked_launcher

    proc = forked_launcher.start().Process(target=forked_launcher.preloaded)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
