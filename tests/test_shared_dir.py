"""A multi-node job stops at start when its output_dir is not shared between the nodes (checkpoint/shared_dir.py)."""

from __future__ import annotations

import pytest

from fsdp_recipes.checkpoint import shared_dir
from fsdp_recipes.errors import EXIT_USER_ERROR, UserError

TWO_NODES = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"}


def test_only_a_job_across_nodes_is_checked():
    assert shared_dir.spans_nodes(TWO_NODES)
    assert not shared_dir.spans_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})
    assert not shared_dir.spans_nodes({"WORLD_SIZE": "8"})  # torchrun sets both; without LOCAL_WORLD_SIZE: one node
    assert not shared_dir.spans_nodes({})


def test_a_node_sees_rank_0s_token_only_in_the_same_directory(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "node-local"
    token = shared_dir.publish(shared)
    assert shared_dir.can_see(token, lambda: shared_dir.read_marker(shared, token), wait_s=0)
    assert not shared_dir.can_see(token, lambda: shared_dir.read_marker(local, token), wait_s=0)
    # a node-local directory holding a previous run's marker (same name, other token) does not pass either
    local.mkdir()
    shared_dir.marker(local, token).write_text("0" * 32)
    assert not shared_dir.can_see(token, lambda: shared_dir.read_marker(local, token), wait_s=0)


def test_a_file_that_shows_up_late_is_waited_for():
    answers = iter([None, None, "tok"])  # a network filesystem showing the new file on the third look
    assert shared_dir.can_see("tok", lambda: next(answers), wait_s=5, poll_s=0)
    assert not shared_dir.can_see("tok", lambda: None, wait_s=0.05, poll_s=0.01)


def test_the_first_node_that_cannot_see_is_named():
    assert shared_dir.first_blind([("a", True), ("a", True), ("b", True)]) is None
    assert shared_dir.first_blind([("a", True), ("b", False), ("c", False)]) == "b"
    assert shared_dir.message("/scratch/run", "node7") == (
        "output_dir /scratch/run is not shared between the nodes (node node7 cannot see rank 0's files). "
        "Fix: put output_dir on a filesystem every node mounts (NFS, Lustre, a PVC with ReadWriteMany)")


def test_no_process_group_or_one_node_writes_nothing(tmp_path):
    shared_dir.check_output_dir_shared(tmp_path / "out", env=TWO_NODES)  # no process group here
    shared_dir.check_output_dir_shared(tmp_path / "out", env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_check_through_a_process_group(world_of_one, tmp_path):
    """The whole check on a gloo group of one, told by the environment that the job spans nodes; `read` stands in
    for what another node's filesystem shows."""
    out = tmp_path / "out"
    shared_dir.check_output_dir_shared(out, env=TWO_NODES, wait_s=0)  # the same directory: passes
    assert list(out.iterdir()) == []  # and leaves no marker behind
    with pytest.raises(UserError) as err:
        shared_dir.check_output_dir_shared(out, env=TWO_NODES, read=lambda token: None, hostname="gpu-b", wait_s=0)
    assert str(err.value) == shared_dir.message(out, "gpu-b")
    assert list(out.iterdir()) == []


def test_who_prints_the_line():
    """Rank 0 names the first node that cannot see; that node's first rank names itself; others exit quietly."""
    reports = [("gpu-a", True), ("gpu-b", False), ("gpu-c", False)]
    assert shared_dir.decide("/o", reports, rank=0, seen=True, hostname="gpu-a") == \
        (True, shared_dir.message("/o", "gpu-b"))
    assert shared_dir.decide("/o", reports, rank=16, seen=False, hostname="gpu-c") == \
        (True, shared_dir.message("/o", "gpu-c"))
    assert shared_dir.decide("/o", reports, rank=9, seen=True, hostname="gpu-b")[0] is False
    assert shared_dir.decide("/o", [("gpu-a", True), ("gpu-b", True)], rank=0, seen=True, hostname="gpu-a") is None
    with pytest.raises(UserError, match="not shared"):
        shared_dir.stop(True, shared_dir.message("/o", "gpu-b"))
    with pytest.raises(SystemExit) as quiet:
        shared_dir.stop(False, shared_dir.message("/o", "gpu-b"))
    assert quiet.value.code == EXIT_USER_ERROR


def test_training_stops_before_anything_reads_output_dir(monkeypatch, capsys):
    """entry.main runs the check right after parsing, before the resume choice reads output_dir, and a node that
    cannot see rank 0's file ends the rank with the one `error:` line."""
    from types import SimpleNamespace

    from fsdp_recipes.train import entry

    out = "/node-local/runs/x"
    monkeypatch.delenv(entry.start_gate.FILE_ENV, raising=False)
    monkeypatch.setattr(entry, "import_training_stack", lambda: None)
    monkeypatch.setattr(entry, "parse_and_check",
                        lambda argv, quiet: SimpleNamespace(training=SimpleNamespace(output_dir=out)))
    monkeypatch.setattr(entry, "checkpoint_to_resume", lambda *a, **k: pytest.fail("output_dir read first"))

    def blind(output_dir):
        raise UserError(shared_dir.message(output_dir, "gpu-b"))

    monkeypatch.setattr(entry, "check_output_dir_shared", blind)  # the entry point holds it since its import
    with pytest.raises(SystemExit) as stopped:
        entry.main([])
    assert stopped.value.code == EXIT_USER_ERROR
    assert capsys.readouterr().err == f"error: {shared_dir.message(out, 'gpu-b')}\n"
