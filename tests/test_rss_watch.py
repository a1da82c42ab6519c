"""rss_watch.RssRise sees an allocation made and freed inside the block, and not memory that was there before."""

import time

from fsdp_recipes.metrics.rss_watch import RssRise, anon_rss_bytes

MIB = 2**20


def test_rise_counts_a_transient_allocation_inside_the_block():
    before = bytearray(64 * MIB)  # held from before: not a rise
    with RssRise(interval_s=0.005) as watch:
        block = bytearray(128 * MIB)  # zero-filled pages: resident once touched
        block[::4096] = b"\x01" * len(block[::4096])
        time.sleep(0.1)  # held for a while, as a gathered state dict is during a save
        del block
    assert 120 * MIB <= watch.rise_bytes <= 200 * MIB, watch.rise_bytes / MIB
    assert anon_rss_bytes() > len(before)
