"""
Restores that skip the sequence rows the live state already holds (arena lineage).

Every restore must leave the state a full copy would leave: these tests run the same
operations on a runtime whose arena never skips anything and compare the live-state digests
after every operation.
"""

import random

from conftest import greedy, PROMPT
import pytest


def _full_copy_only(rt):
    rt.arena.rows_shared = lambda epoch: 0  # as if no lineage were ever known
    return rt


def _seq_bytes(rt):
    return sum(e.nbytes for e in rt.arena.manifest if e.seq_dim is not None)


def test_restore_of_fresh_checkpoint_copies_no_sequence_rows(make_runtime):
    rt = make_runtime(max_seq_len=256)
    rt.prefill(PROMPT * 3)
    info = rt.snapshot('ckpt')
    digest = rt.state_digest()
    tokens = greedy(rt, 12)
    rt.restore('ckpt')
    assert rt.state_digest() == digest
    copied = rt.stats()['last_restore_copied_bytes']
    kv_rows = info.nbytes - (rt.arena.plan(0, False).nbytes)  # the capsule's sequence rows
    assert kv_rows > 0 and copied <= info.nbytes - kv_rows
    assert greedy(rt, 12) == tokens
    rt.restore('ckpt')  # again, after the same tokens were written once more
    assert rt.state_digest() == digest and rt.stats()['last_restore_copied_bytes'] == copied


def test_sibling_branch_and_reset_copy_everything(make_runtime):
    rt = make_runtime(max_seq_len=256)
    rt.prefill(PROMPT)
    rt.snapshot('root')
    greedy(rt, 6)
    b = rt.snapshot('branch-b')
    digest_b = rt.state_digest()
    rt.restore('root')
    greedy(rt, 6, prompt='another way on', temperature=1.0, seed=3)  # rows past root differ
    rt.restore('branch-b')  # shares only root's rows with the live state: copies everything
    assert rt.state_digest() == digest_b
    assert rt.stats()['last_restore_copied_bytes'] == b.nbytes
    rt.reset()
    rt.restore('branch-b')
    assert rt.state_digest() == digest_b
    assert rt.stats()['last_restore_copied_bytes'] == b.nbytes


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_random_operations_match_a_runtime_that_always_copies_everything(
        make_runtime, tmp_path, seed):
    """Prefill, generate, snapshot (every tier), restore (full and kv_only), fork, rollback."""
    fast = make_runtime(max_seq_len=160, rollback_depth=3, capsule_dir=str(tmp_path / 'a'))
    slow = _full_copy_only(make_runtime(max_seq_len=160, rollback_depth=3,
                                        capsule_dir=str(tmp_path / 'b')))
    rng = random.Random(seed)
    names, skipped = [], 0
    for step in range(60):
        op = rng.choice(['prefill', 'generate', 'snapshot', 'snapshot', 'restore', 'restore',
                         'restore', 'rollback', 'fork', 'reset'])
        if fast.position > 120:
            op = 'reset' if not names else 'restore'
        args = ()
        if op == 'prefill':
            args = ([rng.randrange(256) for _ in range(rng.randint(1, 12))],)
        elif op == 'generate':
            args = (rng.randint(1, 5), rng.choice([0.0, 1.0]), rng.randrange(100))
        elif op == 'snapshot':
            args = (f'c{rng.randrange(4)}', rng.choice(['device', 'device', 'host', 'disk']))
        elif op == 'restore' and names:
            args = (rng.choice(names), rng.choice(['full', 'full', 'full', 'kv_only']))
        elif op == 'fork' and names:
            args = (rng.choice(names), f'c{rng.randrange(4)}')
        elif op in ('restore', 'fork'):
            continue
        for rt in (fast, slow):
            if op == 'prefill':
                rt.prefill(args[0])
            elif op == 'generate':
                prompt = 'go' if rt.position == 0 and rt._pending is None else None
                greedy(rt, args[0], prompt=prompt, temperature=args[1], seed=args[2])
            elif op == 'snapshot':
                rt.snapshot(*args)
            elif op == 'restore':
                rt.restore(args[0], mode=args[1])
            elif op == 'rollback':
                if len(rt._ring) < 2:
                    break
                rt.rollback(1)
            elif op == 'fork':
                if args[0] != args[1]:
                    rt.fork(*args)
            else:
                rt.reset()
        if op == 'snapshot' and args[0] not in names:
            names.append(args[0])
        if op == 'fork' and args[0] != args[1] and args[1] not in names:
            names.append(args[1])
        if op in ('restore', 'rollback') and (fast.stats()['last_restore_copied_bytes']
                                              < slow.stats()['last_restore_copied_bytes']):
            skipped += 1
        assert fast.state_digest() == slow.state_digest(), f'step {step}: {op} {args}'
    assert skipped > 0  # the sequence exercised restores that skipped rows
    assert greedy(fast, 8) == greedy(slow, 8)
