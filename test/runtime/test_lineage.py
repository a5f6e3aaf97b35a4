"""
Restores that skip the sequence rows the live state already holds (arena lineage).

Every restore must leave the state a full copy would leave: these tests run the same
operations on a runtime whose arena never skips anything and compare the live-state digests
after every operation.
"""

import random

from flashrt_ros.runtime.models import ModulePolicyAdapter, PolicySpec
from flashrt_ros.runtime.state.arena import StateSpec
import pytest
from runtime_harness import greedy, PROMPT
import torch


def _full_copy_only(rt):
    rt.arena.skip_shared_rows = False  # every restore copies the whole capsule
    rt.ring.head_only = False  # and every boundary is a whole copy
    return rt


def test_restore_of_fresh_checkpoint_copies_no_sequence_rows(make_runtime):
    rt = make_runtime(max_seq_len=256)
    rt.prefill(PROMPT * 3)
    info = rt.snapshot('ckpt')
    digest = rt.state_digest()
    tokens = greedy(rt, 12)
    rt.restore('ckpt')
    assert rt.state_digest() == digest
    copied = rt.stats().last_restore_copied_bytes
    assert copied == rt.arena.packing(0).nbytes < info.nbytes  # the head only, no row
    assert greedy(rt, 12) == tokens
    rt.restore('ckpt')  # again, after the same tokens were written once more
    assert rt.state_digest() == digest and rt.stats().last_restore_copied_bytes == copied


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
    assert rt.stats().last_restore_copied_bytes == b.nbytes
    rt.reset()
    rt.restore('branch-b')
    assert rt.state_digest() == digest_b
    assert rt.stats().last_restore_copied_bytes == b.nbytes


CUDA = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


@pytest.mark.parametrize('seed,device,dtype,back', [
    (0, 'cpu', 'float32', 1), (1, 'cpu', 'float32', 1), (2, 'cpu', 'float32', 1),
    (4, 'cpu', 'float32', 3), (5, 'cpu', 'float32', 3),
    pytest.param(3, 'cuda', 'float32', 3, marks=CUDA),
    pytest.param(6, 'cuda', 'bfloat16', 3, marks=CUDA)])
def test_random_operations_match_a_runtime_that_always_copies_everything(
        make_runtime, tmp_path, seed, device, dtype, back):
    """
    Prefill, generate, snapshot (every tier), restore (full and kv_only), fork, rollback.

    Rollbacks go back by up to `back` boundaries, to entries pushed before restores and
    resets of other branches.
    """
    fast = make_runtime(max_seq_len=160, rollback_depth=3, capsule_dir=str(tmp_path / 'a'),
                        device=device, dtype=dtype)
    slow = _full_copy_only(make_runtime(max_seq_len=160, rollback_depth=3, device=device,
                                        dtype=dtype, capsule_dir=str(tmp_path / 'b')))
    if device == 'cuda':  # graphs live: every decode replays over the restored bytes
        fast.warmup()
        slow.warmup()
        assert fast.stats().cuda_graph, fast.stats().cuda_graph_note
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
        depth = 1 if back == 1 else rng.randint(1, back)
        for rt in (fast, slow):
            if op == 'prefill':
                rt.prefill(args[0])
            elif op == 'generate':
                prompt = 'go' if rt.position == 0 and rt.cursor.pending is None else None
                greedy(rt, args[0], prompt=prompt, temperature=args[1], seed=args[2])
            elif op == 'snapshot':
                rt.snapshot(*args)
            elif op == 'restore':
                rt.restore(args[0], mode=args[1])
            elif op == 'rollback':
                if len(rt.ring) < 2:
                    break
                rt.rollback(min(depth, len(rt.ring) - 1))
            elif op == 'fork':
                if args[0] != args[1]:
                    rt.fork(*args)
            else:
                rt.reset()
        if op == 'snapshot' and args[0] not in names:
            names.append(args[0])
        if op == 'fork' and args[0] != args[1] and args[1] not in names:
            names.append(args[1])
        if op in ('restore', 'rollback') and (fast.stats().last_restore_copied_bytes
                                              < slow.stats().last_restore_copied_bytes):
            skipped += 1
        assert fast.state_digest() == slow.state_digest(), f'step {step}: {op} {args}'
    assert skipped > 0  # the sequence exercised restores that skipped rows
    prompt = PROMPT if fast.position == 0 else None  # a sequence may end on an empty state
    assert greedy(fast, 8, prompt=prompt) == greedy(slow, 8, prompt=prompt)


class _Frames(torch.nn.Module):
    """A policy keeping observations along a sequence axis: all of them, or the last `keep`."""

    def __init__(self, kind='kv', keep=None):
        super().__init__()
        self.lin = torch.nn.Linear(3, 8)
        self.kind, self.keep = kind, keep

    def state_specs(self, max_steps):
        return [StateSpec('frames', self.kind, (self.keep or max_steps, 3), torch.float32,
                          seq_dim=0)]

    def bind(self, views):
        self.frames = views['frames']

    def forward(self, obs, position, generator):
        for i, o in enumerate(obs):
            p = position + i
            if self.keep is None or p < self.keep:
                self.frames[p].copy_(o)
            else:  # full: roll (rows before the position are rewritten)
                self.frames.copy_(torch.cat([self.frames[1:], o[None]]))
        return torch.tanh(self.lin(self.frames.sum(0))).view(4, 2)


def _policy_pair(make_runtime, tmp_path, module):
    out = []
    for name in ('a', 'b'):
        torch.manual_seed(0)
        adapter = ModulePolicyAdapter(module(), PolicySpec(3, 2, 4), max_steps=4096)
        out.append(make_runtime(model='custom', max_seq_len=4096, adapter=adapter,
                                capsule_dir=str(tmp_path / name)))
    _full_copy_only(out[1])
    return out


@pytest.mark.parametrize('max_steps', [128, 256])  # in the row block / in the head
def test_full_restore_after_kv_only_is_the_snapshot_again(make_runtime, max_steps):
    """kv_only leaves a 'recurrent' sequence tensor; its rows past the position end zero."""
    torch.manual_seed(0)
    adapter = ModulePolicyAdapter(_Frames(kind='recurrent'), PolicySpec(3, 2, 4), max_steps)
    rt = make_runtime(model='custom', max_seq_len=128, adapter=adapter)
    assert (rt.arena.entry('frames').strides is None) == (max_steps != 128)
    for i in range(3):
        rt.act([i + 1.0, 0.0, 0.0])
    rt.snapshot('b')
    want = rt.state_digest()
    for i in range(7):
        rt.act([50.0 + i, 0.0, 0.0])
    rt.restore('b', mode='kv_only')  # 'frames' stays the live one up to the position
    assert rt.arena.views['frames'][3:, 0].abs().sum() == 0
    rt.restore('b')
    assert rt.state_digest() == want


def test_a_rolling_window_is_always_copied(make_runtime, tmp_path):
    """A sequence tensor shorter than max_seq_len may roll: restores never skip its rows."""
    fast, slow = _policy_pair(make_runtime, tmp_path, lambda: _Frames(keep=8))
    for rt in (fast, slow):
        for i in range(3):
            rt.act([i, 0.0, 0.0])
        rt.snapshot('early', 'host')
        for i in range(10):  # the window fills and rolls
            rt.act([100 + i, 0.0, 0.0])
        rt.restore('early')
    assert fast.state_digest() == slow.state_digest()
    assert fast.arena.views['frames'][:3, 0].tolist() == [0.0, 1.0, 2.0]


def test_kv_only_restore_of_a_model_with_other_sequence_state_breaks_the_lineage(
        make_runtime, tmp_path):
    """kv_only leaves a 'recurrent' sequence tensor as it was: its rows are not the capsule's."""
    fast, slow = _policy_pair(make_runtime, tmp_path, lambda: _Frames(kind='recurrent'))
    assert fast.arena.entry('frames').strides is not None  # in the row block: rows may be skipped
    for rt in (fast, slow):
        for i in range(5):
            rt.act([i, 1.0, 2.0])
        rt.snapshot('a')
        rt.reset()
        for i in range(5):
            rt.act([-i, 7.0, 9.0])
        rt.restore('a', mode='kv_only')
        rt.restore('a')
    assert fast.state_digest() == slow.state_digest()
    assert fast.arena.views['frames'][:5, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
