"""
Rollback-ring boundaries of the live lineage hold the head only (state/ring.py).

A commit copies the state's head (no sequence rows) whatever the context length; a rollback
to such a boundary copies the head back and zeroes the rows written since, and must leave
the state byte for byte as it was at the boundary. Boundaries whose rows the live state no
longer holds (another branch restored, a reset) leave the ring.
"""

from flashrt_ros.runtime import InvalidRequestError
import pytest
from runtime_harness import greedy, HYBRIDS, PROMPT


@pytest.mark.parametrize('model', HYBRIDS[:2])
def test_rollback_to_head_only_boundaries_is_byte_identical_and_decodes_on(make_runtime, model):
    rt = make_runtime(model, max_seq_len=256, rollback_depth=8)
    head = rt.arena.head_nbytes
    boundaries = []  # (digest, the greedy continuation) at every commit
    for prompt in (PROMPT, ' and then', ' puts it down on the table'):
        rt.prefill(prompt)
        assert rt.stats().rollback_ring.last_commit_bytes == head  # no row copied
        digest = rt.state_digest()
        boundaries.append((digest, greedy(rt, 6, temperature=1.0, seed=7)))
        assert rt.stats().rollback_ring.last_commit_bytes == head  # the turn's end too
        rt.rollback(1)
        assert rt.state_digest() == digest
    assert rt.stats().rollback_ring.bytes_used == len(rt.ring) * head
    for back, (digest, tokens) in zip((1, 1), reversed(boundaries[:2])):
        rt.rollback(back)
        assert rt.state_digest() == digest
        assert greedy(rt, 6, temperature=1.0, seed=7) == tokens
        rt.rollback(1)
        assert rt.state_digest() == digest


def test_commit_cost_does_not_grow_with_the_context(make_runtime):
    rt = make_runtime(max_seq_len=512, rollback_depth=4)
    copied = []
    for _ in range(4):
        rt.prefill([3] * 100)
        copied.append(rt.stats().rollback_ring.last_commit_bytes)
    assert rt.position == 400
    assert copied == [rt.arena.head_nbytes] * 4
    assert rt.arena.packing(400).nbytes > 4 * rt.arena.head_nbytes  # what a whole copy was
    whole = make_runtime(max_seq_len=512, rollback_depth=4)
    whole.ring.head_only = False  # the reference: boundaries as whole copies
    whole.prefill([3] * 400)
    assert whole.stats().rollback_ring.last_commit_bytes == whole.arena.packing(400).nbytes


def test_restoring_another_branch_drops_the_boundaries_past_what_it_shares(make_runtime):
    rt = make_runtime(max_seq_len=256, rollback_depth=8)
    rt.prefill(PROMPT)
    at_home = rt.state_digest()
    rt.snapshot('home')
    rt.prefill(' and then')
    greedy(rt, 4)  # two more boundaries past 'home'
    assert [c.position for c in rt.ring][-3] == rt.store.get('home').position
    info = rt.restore('home')
    ring = rt.stats().rollback_ring
    assert ring.lineage_drops == 2  # both were past the rows 'home' shares
    assert [c.position for c in rt.ring] == [0, info.position, info.position]
    assert rt.stats().last_restore_copied_bytes == rt.arena.head_nbytes  # the e-stop: cheap
    rt.rollback(1)  # the prefill's own boundary, still a prefix of the live rows
    assert rt.state_digest() == at_home
    rt.rollback(1)
    assert rt.position == 0
    with pytest.raises(InvalidRequestError, match='only 0 earlier boundaries'):
        rt.rollback(1)


def test_a_sibling_branch_and_a_reset_leave_only_what_the_live_rows_hold(make_runtime):
    rt = make_runtime(max_seq_len=256, rollback_depth=8)
    rt.prefill(PROMPT)
    rt.snapshot('root')
    greedy(rt, 5)
    rt.snapshot('b')
    digest_b = rt.state_digest()
    rt.restore('root')
    greedy(rt, 5, prompt=' another way', temperature=1.0, seed=2)
    rt.restore('b')  # copied whole: the live rows past 'root' were another branch's
    root = rt.store.get('root').position  # its commit, then 'root' restored: both kept
    b_position = rt.position
    assert [c.position for c in rt.ring] == [0, root, root, b_position]
    rt.prefill(' on b')
    rt.rollback(1)
    assert rt.state_digest() == digest_b
    rt.prefill(' on b')
    rt.reset()  # zeroes every row: commits past position 0 go, restored capsules stay
    assert [c.position for c in rt.ring] == [0, root, b_position, 0]
    assert rt.stats().rollback_ring.last_commit_bytes == rt.arena.head_nbytes
    rt.rollback(1)  # 'b' itself: whole, so it needs no rows of the live state
    assert rt.state_digest() == digest_b


def test_a_forgotten_lineage_refuses_the_rollback_instead_of_restoring_wrong_rows(
        make_runtime):
    rt = make_runtime(max_seq_len=256, rollback_depth=8)
    rt.prefill(PROMPT)
    rt.prefill(' and then')
    digest = rt.state_digest()
    rt.arena.begin_epoch()  # nothing says any more which rows the boundaries share
    with pytest.raises(InvalidRequestError, match='only 0 earlier boundaries'):
        rt.rollback(1)
    assert rt.state_digest() == digest  # refused: nothing changed
