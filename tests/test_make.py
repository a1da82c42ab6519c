"""The Makefile's set-up steps as a person sees them: `make venv`'s few lines and its log, and what `make test` says
when it cannot install Slurm."""

import os
import shutil
import subprocess
import sys

from conftest import REPO


def test_a_failing_make_venv_step_names_its_log(tmp_path):
    venv, missing = tmp_path / "venv", tmp_path / "torch-0-py3-none-any.whl"
    # as from a shell: not as a sub-make of `make test` (make[1]: ..., its MAKEFLAGS)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    res = subprocess.run(["make", "--no-print-directory", "venv", f"VENV={venv}", f"PYTHON={sys.executable}",
                          f"TORCH_SPEC={missing}", "CONSTRAINTS="], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    log = venv / "install.log"
    assert res.returncode != 0
    assert res.stdout.splitlines() == [
        f"[venv] creating {venv} with Python {sys.version.split()[0]}; pip's output goes to {log}",
        f"[venv] installing {missing}"]
    err = res.stderr.splitlines()  # pip's last lines, this line, then make's own "make: *** [...] Error 1"
    assert err[-2] == f"[venv] failed; pip's whole output: {log}" and err[-1].startswith("make: ***") and len(err) <= 7
    assert str(missing) in log.read_text()  # pip's own error, kept whole in the log
    assert not (venv / ".installed").exists()  # the next `make venv` tries again


def test_make_test_says_which_tests_skip_where_it_cannot_install_slurm(tmp_path):
    """A machine without Slurm or apt-get (a PATH with only what the script itself needs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    res = subprocess.run([str(bin_dir / "bash"), "scripts/install_slurm.sh", "--if-possible"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={"PATH": str(bin_dir)})
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.splitlines() == [
        "[test] no Slurm here (missing slurmctld slurmd sbatch munged): the tests of tests/test_slurm.py will skip. "
        "To run them: sudo scripts/install_slurm.sh"]
