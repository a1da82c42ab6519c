"""rss_watch.RssRise sees an allocation made and freed inside the block, and not memory that was there before."""

import time

from fsdp_recipes.metrics.rss_watch import RssRise, anon_rss_bytes

MIB = 2**20
PAGE = 4096


def touched(n_bytes: int) -> bytearray:
    """n_bytes of anonymous memory, every page written once: resident (bytearray's zero pages are not until touched)."""
    block = bytearray(n_bytes)
    block[::PAGE] = b"\x01" * len(block[::PAGE])
    return block


def test_rise_counts_a_transient_allocation_inside_the_block():
    size = 256 * MIB
    held = touched(128 * MIB)  # resident from before the block: not a rise
    with RssRise(interval_s=0.005) as watch:
        block = touched(size)
        time.sleep(0.1)  # held for a while, as a gathered state dict is during a save
        del block  # freed before the block ends: only a sampled peak can see it
    after = anon_rss_bytes()
    # the 256 MiB written, within a tolerance for the allocator and the interpreter (a lower bound: sampled)
    assert 0.8 * size <= watch.rise_bytes <= 1.25 * size, watch.rise_bytes / MIB
    # and the memory really went back: the figure is the peak inside the block, not where the block ended
    assert after - watch.start < 0.25 * size, (after - watch.start) / MIB
    del held


def test_a_block_that_allocates_nothing_rises_by_next_to_nothing():
    held = touched(64 * MIB)  # resident before and during the block: the rise is measured from the entry, not from 0
    with RssRise(interval_s=0.005) as watch:
        time.sleep(0.1)
    assert 0 <= watch.rise_bytes < 16 * MIB, watch.rise_bytes / MIB  # well below the 256 MiB above; 64 MiB held
    del held
