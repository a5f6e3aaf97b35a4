"""Memory the runtime holds outside the capsule tiers: the rollback ring and warm-up."""

from conftest import PROMPT
from flashrt_ros.runtime import ConfigError, InvalidRequestError, RuntimeConfig
import pytest


def test_the_ring_drops_its_oldest_entries_to_stay_within_its_budget(make_runtime):
    probe = make_runtime()
    probe.prefill([5] * 20)
    entry = probe.ring[-1].nbytes  # one boundary at position 20
    rt = make_runtime(rollback_depth=8, ring_budget_bytes=3 * entry)
    assert rt.stats().rollback_ring.budget == 3 * entry
    for n in range(1, 9):
        rt.prefill([5] * 20 if n == 1 else [6])  # every entry is at least `entry`
        ring = rt.stats().rollback_ring
        assert ring.bytes_used == sum(c.nbytes for c in rt.ring) <= 3 * entry
        assert rt.ring[-1].position == rt.position  # the newest is the live boundary
    assert len(rt.ring) == 2  # two of 21+ tokens fit in three of 20, a third does not
    live = rt.state_digest()
    rt.prefill([7])
    rt.rollback(1)
    assert rt.state_digest() == live
    with pytest.raises(InvalidRequestError, match='ring_budget_bytes'):
        rt.rollback(1)  # the older boundaries were dropped for the budget


def test_a_ring_budget_below_one_entry_keeps_the_live_boundary(make_runtime):
    rt = make_runtime(rollback_depth=8, ring_budget_bytes=1)
    rt.prefill(PROMPT)
    rt.prefill('and more')
    assert len(rt.ring) == 1 and rt.ring[-1].position == rt.position
    with pytest.raises(InvalidRequestError, match='only 0 earlier boundaries'):
        rt.rollback(1)


def test_ring_budget_is_validated_and_0_is_unlimited(make_runtime):
    with pytest.raises(ConfigError, match='ring_budget_bytes'):
        RuntimeConfig(ring_budget_bytes=-1)
    assert RuntimeConfig().ring_budget_bytes == 256 << 20
    rt = make_runtime(rollback_depth=6, ring_budget_bytes=0)
    for _ in range(8):
        rt.prefill([4] * 10)
    assert len(rt.ring) == 6 and rt.stats().rollback_ring.budget == 0
