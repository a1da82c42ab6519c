"""The end-of-run summary prints what a terminal shows cleanly."""

from fsdp_recipes.launch.summary import shown


def test_undecodable_generations_are_escaped_not_printed_as_mojibake():
    # what a random-weight model's generation decodes to: byte-level pieces that are not valid UTF-8
    garbled = b"\xe4\xb8".decode("utf-8", errors="replace") * 4
    assert shown(garbled) == "'" + "\\ufffd" * 4 + "'"
    assert shown("ok\x07") == "'ok\\x07'"  # a control character (BEL) too
    assert shown("14") == "'14'" and shown("café") == "'café'"  # ordinary text stays as it was
