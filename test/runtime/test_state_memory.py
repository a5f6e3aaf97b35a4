"""Memory the runtime holds outside the capsule tiers: the rollback ring and warm-up."""

from flashrt_ros.runtime import ConfigError, InvalidRequestError, RuntimeConfig
import pytest
from runtime_harness import greedy, PROMPT
import torch


def test_the_ring_drops_its_oldest_entries_to_stay_within_its_budget(make_runtime):
    probe = make_runtime()
    head = probe.arena.head_nbytes  # what a commit's boundary holds
    rt = make_runtime(rollback_depth=8, ring_budget_bytes=3 * head)
    assert rt.stats().rollback_ring.budget == 3 * head
    for n in range(1, 9):
        rt.prefill([5] * 20 if n == 1 else [6])
        ring = rt.stats().rollback_ring
        assert ring.bytes_used == sum(c.nbytes for c in rt.ring) <= 3 * head
        assert rt.ring[-1].position == rt.position  # the newest is the live boundary
    assert len(rt.ring) == 3
    live = rt.state_digest()
    rt.prefill([7])
    rt.rollback(1)
    assert rt.state_digest() == live
    rt.rollback(1)  # the third entry kept
    with pytest.raises(InvalidRequestError, match='ring_budget_bytes'):
        rt.rollback(1)  # the older boundaries were dropped for the budget


def test_the_ring_budget_counts_a_restored_capsule_once(make_runtime):
    rt = make_runtime(rollback_depth=8)
    rt.prefill([5] * 40)
    whole = rt.snapshot('home').nbytes
    greedy(rt, 4)
    for _ in range(3):
        rt.restore('home')  # the ring holds the capsule itself, three times
    ring = rt.stats().rollback_ring
    assert ring.count == 5 and ring.bytes_used == 2 * rt.arena.head_nbytes + whole
    budgeted = make_runtime(rollback_depth=8, ring_budget_bytes=whole + rt.arena.head_nbytes)
    budgeted.prefill([5] * 40)
    budgeted.snapshot('home')
    for _ in range(3):
        budgeted.restore('home')
    assert len(budgeted.ring) == 4  # the prefill's head and 'home' thrice: reset's went


def test_a_ring_budget_below_one_entry_keeps_the_live_boundary(make_runtime):
    rt = make_runtime(rollback_depth=8, ring_budget_bytes=1)
    rt.prefill(PROMPT)
    rt.prefill('and more')
    assert len(rt.ring) == 1 and rt.ring[-1].position == rt.position
    with pytest.raises(InvalidRequestError, match='only 0 earlier boundaries'):
        rt.rollback(1)


def test_ring_budget_is_validated_and_0_is_unlimited(make_runtime):
    with pytest.raises(ConfigError, match='ring_budget_bytes'):
        RuntimeConfig(ring_budget_bytes=-2)
    assert RuntimeConfig().ring_budget_bytes == -1  # sized from the arena
    assert RuntimeConfig().sized_budgets(1 << 20)['ring'] == 256 << 20
    rt = make_runtime(rollback_depth=6, ring_budget_bytes=0)
    for _ in range(8):
        rt.prefill([4] * 10)
    assert len(rt.ring) == 6 and rt.stats().rollback_ring.budget == 0


def test_warmup_saves_the_used_state_not_a_second_arena(make_runtime):
    rt = make_runtime(max_seq_len=4096)
    greedy(rt, 3, prompt=PROMPT)  # mid-conversation: a pending token, rows in use
    digest, position = rt.state_digest(), rt.position
    saved = []
    capture = rt.codec.capture
    rt.codec.capture = lambda *a, **kw: saved.append(capture(*a, **kw)) or saved[-1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        rt.warmup()
    del rt.codec.capture
    assert rt.state_digest() == digest
    assert [c.nbytes for c in saved] == [rt.arena.prefix_nbytes(position)]
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < rt.arena.nbytes // 8  # no copy of the whole arena (4096 rows)


def test_warmup_of_a_policy_leaves_its_state_and_queue(make_runtime):
    rt = make_runtime('builtin:tiny-policy')
    rt.act(torch.linspace(-1, 1, rt.policy_spec.obs_dim))
    digest = rt.state_digest()
    rt.warmup()
    assert rt.state_digest() == digest and len(rt.pending_actions()) == rt.policy_spec.horizon
