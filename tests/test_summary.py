"""The end-of-run summary prints what a terminal shows cleanly."""

from fsdp_recipes.launch.summary import shown


def test_undecodable_generations_are_escaped_not_printed_as_mojibake():
    # what a random-weight model's generation decodes to: byte-level pieces that are not valid UTF-8
    garbled = b"\xe4\xb8".decode("utf-8", errors="replace") * 4
    assert shown(garbled) == "'" + "\\ufffd" * 4 + "'"
    assert shown("ok\x07") == "'ok\\x07'"  # a control character (BEL) too
    assert shown("14") == "'14'" and shown("café") == "'café'"  # ordinary text stays as it was


def test_a_replica_rank_shows_no_warnings_or_progress_bars(monkeypatch):
    """What ranks other than 0 switch off, so that the console shows each library warning and bar once."""
    import warnings
    from types import SimpleNamespace

    import datasets
    import transformers

    from fsdp_recipes.train.train_sft import quiet_replica

    monkeypatch.setattr(warnings, "filters", list(warnings.filters))  # restored after the test
    cfg = SimpleNamespace(training=SimpleNamespace(log_level_replica="warning"))
    try:
        quiet_replica(cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("from a replica", FutureWarning)
        assert caught == []
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert datasets.is_progress_bar_enabled() is False
        assert cfg.training.log_level_replica == "error"
        cfg.training.log_level_replica = "info"  # a recipe's own choice stays
        quiet_replica(cfg)
        assert cfg.training.log_level_replica == "info"
    finally:
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()
