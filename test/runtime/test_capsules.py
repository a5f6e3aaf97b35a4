"""Capsule store: fork, rollback, disk tier, corruption, budgets and names."""

import contextlib
import json
import os
import resource
import signal
import threading
import time
import weakref

from flashrt_ros.runtime import (
    BudgetExceededError,
    BusyError,
    CapsuleNotFoundError,
    CorruptCapsuleError,
    FingerprintMismatchError,
    FlashRTError,
    InvalidNameError,
    InvalidRequestError,
)
from flashrt_ros.runtime.state.disk import checksum, STALE_TEMP_S
from flashrt_ros.runtime.state.memory import BlobPool
from flashrt_ros.runtime.stats import TierStats
import pytest
from runtime_harness import greedy, OTHER_PROMPT, PROMPT
from safetensors import safe_open
from safetensors.torch import save
import torch


def _blob_bytes(rt, name):
    return bytes(rt.store.get(name).blob.cpu().numpy())


def test_fork_gives_independent_branches(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('trunk')
    fork = rt.fork('trunk', 'branch')
    assert fork.name == 'branch' and fork.position == rt.position
    trunk_bytes = _blob_bytes(rt, 'trunk')
    assert _blob_bytes(rt, 'branch') == trunk_bytes
    assert rt.store.get('branch').blob.data_ptr() != rt.store.get('trunk').blob.data_ptr()
    # Advance the branch and save over it; the trunk stays byte-identical.
    rt.restore('branch')
    branch_tokens = greedy(rt, 8, prompt=OTHER_PROMPT)
    rt.snapshot('branch')
    assert _blob_bytes(rt, 'trunk') == trunk_bytes
    rt.restore('trunk')
    trunk_tokens = greedy(rt, 8, prompt=OTHER_PROMPT)
    assert trunk_tokens == branch_tokens  # same start, same input -> same tokens
    assert rt.list_capsules()[0].name == 'trunk'
    assert {c.name for c in rt.list_capsules()} == {'trunk', 'branch'}


def test_fork_across_tiers(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('a')
    digest = rt.state_digest()
    assert rt.fork('a', 'a-host', tier='host').tier == 'host'
    assert rt.fork('a-host', 'a-disk', tier='disk').tier == 'disk'
    greedy(rt, 5)
    rt.restore('a-disk')
    assert rt.state_digest() == digest


def test_rollback_returns_to_earlier_boundaries_exactly(make_runtime):
    rt = make_runtime(rollback_depth=4)
    rt.prefill(PROMPT)
    after_prefill = rt.state_digest()
    first = greedy(rt, 6)
    after_turn = rt.state_digest()
    greedy(rt, 6, prompt=OTHER_PROMPT)  # two more boundaries: end of prefill, end of turn
    info = rt.rollback(2)
    assert info.name == f'@boundary-{rt.position}'
    assert rt.state_digest() == after_turn
    info = rt.rollback(1)
    assert rt.state_digest() == after_prefill and info.position == rt.position
    assert greedy(rt, 6) == first
    with pytest.raises(InvalidRequestError, match='boundaries'):
        rt.rollback(10)


def test_rollback_undoes_a_restore_when_the_state_before_it_is_still_held(make_runtime):
    rt = make_runtime()
    rt.snapshot('empty')
    rt.prefill(PROMPT)
    rt.snapshot('prompt')
    digest = rt.state_digest()
    rt.restore('empty')  # the prompt's commit needs the rows this zeroes: it leaves the ring
    assert rt.stats().rollback_ring.lineage_drops == 1
    rt.restore('prompt')
    rt.restore('empty')
    rt.rollback(1)  # 'prompt' went on the ring whole: the restore is undone
    assert rt.state_digest() == digest
    rt.prefill(' and')
    rt.restore('prompt')  # a boundary of the same branch: the commit before stays
    rt.rollback(1)
    assert rt.state_digest() == digest


def test_boundaries_the_ring_drops_are_freed_by_the_next_capture_not_by_a_restore(make_runtime):
    rt = make_runtime(rollback_depth=2)
    rt.prefill(PROMPT)
    rt.snapshot('x')
    rt.prefill('and')
    rt.prefill('and')  # the ring: two boundaries captured by commits, held nowhere else
    dropped = [weakref.ref(c) for c in rt.ring]
    rt.restore('x')
    rt.restore('x')  # each pushes 'x' itself and drops the oldest entry
    assert all(ref() is not None for ref in dropped)  # kept: a restore pays no teardown
    retired = rt.stats().rollback_ring
    assert retired.retired_count == 2
    assert retired.retired_bytes == sum(ref().nbytes for ref in dropped)
    rt.snapshot('y')  # a capture frees them before it allocates
    assert all(ref() is None for ref in dropped) and not rt.ring.retired
    assert rt.stats().rollback_ring.retired_bytes == 0
    rt.prefill('and')
    rt.prefill('and')
    dropped = [weakref.ref(c) for c in rt.ring]
    digest = rt.state_digest()
    rt.prefill('and')
    dropped.append(weakref.ref(rt.ring[-1]))
    rt.rollback(1)  # the entry it pops is retired too
    assert rt.state_digest() == digest and dropped[-1]() is not None
    for _ in range(4):
        rt.restore('x')
    assert len(rt.ring.retired) == 2  # at most one ring's worth: the oldest went on the way
    assert all(ref() is None for ref in dropped)
    assert rt.stats().rollback_ring.retired_bytes == 0  # 'x' is stored: nothing waits


def test_deleting_the_restored_capsules_frees_what_the_ring_dropped(make_runtime):
    rt = make_runtime(rollback_depth=3)
    for name in ('a', 'b', 'c'):
        rt.prefill('and')
        rt.snapshot(name)
    rt.prefill('and')  # the ring: 3 boundaries captured by commits, held nowhere else
    dropped = [weakref.ref(c) for c in rt.ring]
    for name in ('a', 'b', 'c'):
        rt.restore(name)  # the ring now holds the three stored capsules
    assert all(ref() is not None for ref in dropped)
    a_bytes = rt.store.get('a').nbytes
    rt.delete_capsule('a')  # the ring's 'a' becomes private: the retired entries go
    assert all(ref() is None for ref in dropped)
    assert rt.stats().rollback_ring.retired_bytes == 0
    rt.restore('b')  # pushes 'a' off the ring: held nowhere else now, it waits
    assert rt.stats().rollback_ring.retired_bytes == a_bytes


def test_memory_snapshots_work_when_the_capsule_dir_cannot_exist(make_runtime, tmp_path):
    blocker = tmp_path / 'a-file'
    blocker.write_text('not a directory')
    rt = make_runtime(capsule_dir=str(blocker))
    rt.prefill(PROMPT)
    rt.snapshot('a')
    rt.snapshot('a')  # replacing looks for a same-named disk file: there is no directory
    assert [c.name for c in rt.list_capsules()] == ['a']
    rt.restore('a')
    assert rt.delete_capsule('a').name == 'a'


@pytest.mark.parametrize('tier', ['device', 'disk'])
def test_restore_racing_close_says_the_runtime_is_closed(make_runtime, monkeypatch, tier):
    rt = make_runtime()
    rt.snapshot('c', tier=tier)
    get = rt.store.get

    def get_after_close(name):  # close() lands between the fetch and the check
        rt.close()
        return get(name)

    monkeypatch.setattr(rt.store, 'get', get_after_close)
    with pytest.raises(FlashRTError, match='closed'):
        rt.restore('c')


def test_disk_round_trip_across_runtimes(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    info = rt.snapshot('saved', tier='disk')
    assert info.tier == 'disk' and len(info.checksum) == 64
    digest = rt.state_digest()
    expected = greedy(rt, 10)
    rt.close()
    fresh = make_runtime()
    assert [c.name for c in fresh.list_capsules(tier='disk')] == ['saved']
    fresh.restore('saved')
    assert fresh.state_digest() == digest
    assert greedy(fresh, 10) == expected


def _disk_file(rt, name):
    return rt.config.capsule_path / f'{name}.safetensors'


def _damage_flip(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the blob
    path.write_bytes(bytes(data))


def _damage_header(path):
    data = bytearray(path.read_bytes())
    i = data.index(b'"position')
    data[i + 1] = ord('q')  # still valid JSON for safetensors, wrong content
    path.write_bytes(bytes(data))


def _damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _moved_on_from_disk_capsule(make_runtime):
    """Return a runtime with disk capsule 'c' of an older state, and the live digest."""
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('c', tier='disk')
    greedy(rt, 4, prompt=OTHER_PROMPT)
    return rt, rt.state_digest()


@pytest.mark.parametrize('damage', [_damage_flip, _damage_header, _damage_truncate])
def test_damaged_disk_capsule_is_refused_and_state_untouched(make_runtime, damage):
    rt, live = _moved_on_from_disk_capsule(make_runtime)
    damage(_disk_file(rt, 'c'))
    with pytest.raises(CorruptCapsuleError, match='delete'):
        rt.restore('c')
    assert rt.state_digest() == live
    with pytest.raises(CorruptCapsuleError):
        rt.verify_capsule('c')
    # A file whose header cannot be read is not listed, but named as unreadable.
    unreadable = []
    listed = {i.name for i in rt.list_capsules(unreadable=unreadable)}
    header_reads = damage is not _damage_truncate  # (_damage_header hits the meta)
    assert ('c' in listed, unreadable) == (header_reads, [] if header_reads else ['c'])
    # The error says "delete it", so deleting must work on a file that cannot be parsed.
    assert rt.delete_capsule('c').tier == 'disk'
    assert not _disk_file(rt, 'c').exists()
    assert 'c' not in {i.name for i in rt.list_capsules()}


def _resign(path, edit):
    """Change a capsule file's header and sign it again: only the capsule's checks can tell."""
    with safe_open(str(path), framework='pt') as f:
        header = json.loads(f.metadata()['flashrt'])
        blob = f.get_tensor('blob').clone()
    edit(header)
    header_json = json.dumps(header, sort_keys=True)
    path.write_bytes(save({'blob': blob}, metadata={
        'flashrt': header_json, 'checksum': checksum(blob, header_json)}))


def _unknown_layer(header):
    meta = json.loads(header['meta'])
    meta['adapter']['layers']['999'] = {'cumulative_length_int': 3}  # no such layer
    header['meta'] = json.dumps(meta, sort_keys=True)


def _other_position(header):
    header['position'] += 1  # the meta still says the old one


def _meta_edit(change):
    def edit(header):
        meta = json.loads(header['meta'])
        change(meta)
        header['meta'] = json.dumps(meta, sort_keys=True)
    return edit


def _rename_first_layer(meta):
    layers = meta['adapter']['layers']
    key = sorted(layers)[0]
    layers['0' + key] = layers.pop(key)  # int() reads the same layer; not what export wrote


_drop_a_layer = _meta_edit(lambda m: m['adapter']['layers'].popitem())
_flags_of_ints = _meta_edit(lambda m: [d.update(has_previous_state=[1])
                                       for d in m['adapter']['layers'].values()])
_pending_out_of_vocab = _meta_edit(lambda m: m.update(pending=99999))
_invalid_sampler_state = _meta_edit(lambda m: m.update(rng='00' * (len(m['rng']) // 2)))


@pytest.mark.parametrize('edit', [
    _unknown_layer, _other_position, _meta_edit(_rename_first_layer), _drop_a_layer,
    _flags_of_ints, _pending_out_of_vocab, _invalid_sampler_state])
def test_disk_capsule_that_does_not_fit_is_refused_before_any_write(make_runtime, edit):
    rt, live = _moved_on_from_disk_capsule(make_runtime)
    _resign(_disk_file(rt, 'c'), edit)
    with pytest.raises(CorruptCapsuleError, match='delete'):
        rt.restore('c')
    assert rt.state_digest() == live


def test_capsule_from_another_model_is_refused(make_runtime):
    other = make_runtime('builtin:tiny-qwen3-5')
    other.prefill(PROMPT)
    other.snapshot('foreign', tier='disk')
    longer = make_runtime(max_seq_len=256)  # same model, other layout
    longer.prefill(PROMPT)
    longer.snapshot('long', tier='disk')
    rt = make_runtime()
    rt.prefill(OTHER_PROMPT)
    live = rt.state_digest()
    for name in ('foreign', 'long'):
        with pytest.raises(FingerprintMismatchError, match='different model'):
            rt.restore(name)
        assert rt.state_digest() == live


def test_verify_seals_and_detects_memory_corruption(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    assert rt.snapshot('m').checksum == ''  # lazy: not computed on the fast path
    sealed = rt.verify_capsule('m')
    assert len(sealed.checksum) == 64
    assert rt.verify_capsule('m').checksum == sealed.checksum
    rt.store.get('m').blob[3] ^= 0xFF  # simulate a bit flip in memory
    with pytest.raises(CorruptCapsuleError):
        rt.verify_capsule('m')


def test_budget_refuse_policy_and_exact_accounting(make_runtime):
    probe = make_runtime()
    probe.prefill(PROMPT)
    size = probe.snapshot('x').nbytes
    rt = make_runtime(device_budget_bytes=2 * size + size // 2, eviction='refuse')
    rt.prefill(PROMPT)
    a, b = rt.snapshot('a'), rt.snapshot('b')
    assert rt.stats().tiers['device'].bytes_used == a.nbytes + b.nbytes
    assert sum(c.nbytes for c in rt.list_capsules('device')) == a.nbytes + b.nbytes
    with pytest.raises(BudgetExceededError, match='full'):
        rt.snapshot('c')
    assert {c.name for c in rt.list_capsules()} == {'a', 'b'}
    rt.snapshot('a')  # overwriting frees the old copy first
    rt.delete_capsule('b')
    assert rt.stats().tiers['device'] == TierStats(
        count=1,
        bytes_used=a.nbytes,
        budget=2 * size + size // 2,
    )


def test_budget_lru_evicts_oldest_unpinned(make_runtime):
    probe = make_runtime()
    probe.prefill(PROMPT)
    size = probe.snapshot('x').nbytes
    rt = make_runtime(device_budget_bytes=3 * size, eviction='lru')
    rt.prefill(PROMPT)
    rt.snapshot('pinned', pinned=True)
    rt.snapshot('old')
    rt.snapshot('young')
    rt.restore('old')  # 'young' is now least recently used
    assert rt.drain_evictions() == []
    rt.snapshot('new')
    assert {c.name for c in rt.list_capsules()} == {'pinned', 'old', 'new'}
    evicted = rt.drain_evictions()  # reported once, for telemetry
    assert [(i.name, i.tier, i.nbytes) for i in evicted] == [('young', 'device', size)]
    assert rt.drain_evictions() == []
    assert rt.stats().tiers['device'].bytes_used == 3 * size
    with pytest.raises(BudgetExceededError):
        make_runtime(device_budget_bytes=size // 2, eviction='lru').snapshot('too-big')


def test_disk_budget_counts_file_bytes(make_runtime):
    rt = make_runtime(disk_budget_bytes=1 << 30)
    rt.prefill(PROMPT)
    info = rt.snapshot('d', tier='disk')
    path = _disk_file(rt, 'd')
    assert info.nbytes == os.path.getsize(path) == rt.stats().tiers['disk'].bytes_used
    rt.delete_capsule('d')
    assert not path.exists() and rt.stats().tiers['disk'].bytes_used == 0


@contextlib.contextmanager
def _file_size_limit(nbytes):
    """Make writes past nbytes fail with EFBIG (a real short write, as a full disk gives)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_failed_disk_write_replaces_and_evicts_nothing(make_runtime):
    # A real short write: the file-size limit stops it part way (EFBIG), after the budget's
    # victims were chosen.
    sizing = make_runtime()
    sizing.prefill(PROMPT)
    size = sizing.snapshot('a', tier='disk').nbytes
    sizing.delete_capsule('a')
    rt = make_runtime(eviction='lru', disk_budget_bytes=2 * size)  # 'c' would evict 'a'
    rt.prefill(PROMPT)
    rt.snapshot('a', tier='disk')
    rt.snapshot('b', tier='disk')
    rt.snapshot('c', tier='device')
    digest = rt.state_digest()
    with _file_size_limit(size // 2), pytest.raises(
            FlashRTError, match='nothing was replaced or evicted'):
        rt.snapshot('c', tier='disk')
    assert {(i.name, i.tier) for i in rt.list_capsules()} == {
        ('a', 'disk'), ('b', 'disk'), ('c', 'device')}
    assert not [p for p in rt.config.capsule_path.iterdir() if p.name.startswith('.')]
    assert rt.drain_evictions() == []
    for name in ('a', 'c'):
        rt.reset()
        rt.restore(name)
        assert rt.state_digest() == digest


def test_a_disk_write_cut_short_keeps_the_old_file(make_runtime):
    # A real short write: the file-size limit stops it part way (EFBIG), as a full disk would.
    rt = make_runtime()
    rt.prefill(PROMPT)
    old = rt.snapshot('a', tier='disk')
    digest = rt.state_digest()
    rt.prefill(OTHER_PROMPT)  # a longer state: a bigger file
    with _file_size_limit(old.nbytes + 10), pytest.raises(FlashRTError,
                                                          match='could not be written'):
        rt.snapshot('a', tier='disk')
    assert rt.verify_capsule('a').position == old.position
    rt.restore('a')
    assert rt.state_digest() == digest


def test_temp_files_a_killed_write_left_are_swept_at_start(make_runtime, tmp_path):
    capsules = tmp_path / 'capsules'
    capsules.mkdir()
    old, fresh = capsules / '.a.x1.tmp', capsules / '.b.x2.tmp'
    old.write_bytes(b'half a capsule')
    fresh.write_bytes(b'another process is writing this one')
    os.utime(old, (time.time() - 2 * STALE_TEMP_S,) * 2)
    make_runtime(capsule_dir=str(capsules))
    assert not old.exists() and fresh.exists()


@pytest.mark.parametrize(
    'name',
    [
        '',
        '../escape',
        'a/b',
        'a\\b',
        '..',
        '.hidden',
        'x' * 129,
        'semi;colon',
        'sp ace',
        'trailing-newline\n',
        'ab\x00cd',  # cut at the NUL by C code: 'ab'
        None,
        '@boundary-3',
    ],
)
def test_bad_names_are_refused(make_runtime, name):
    rt = make_runtime()
    for call in (
        lambda: rt.snapshot(name),
        lambda: rt.snapshot(name, tier='disk'),
        lambda: rt.restore(name),
        lambda: rt.delete_capsule(name),
        lambda: rt.fork('ok', name),
    ):
        with pytest.raises(InvalidNameError):
            call()
    assert not list(rt.config.capsule_path.parent.rglob('*escape*'))


def test_unknown_names_are_refused(make_runtime):
    rt = make_runtime()
    live = rt.state_digest()
    for call in (
        lambda: rt.restore('nope'),
        lambda: rt.fork('nope', 'x'),
        lambda: rt.delete_capsule('nope'),
        lambda: rt.verify_capsule('nope'),
    ):
        with pytest.raises(CapsuleNotFoundError, match='list_capsules'):
            call()
    assert rt.state_digest() == live


def test_packed_snapshot_is_smaller_than_the_arena(make_runtime):
    rt = make_runtime(max_seq_len=512)
    rt.prefill(PROMPT)
    host = rt.snapshot('h', tier='host')
    assert host.nbytes < rt.state_nbytes / 2
    assert isinstance(rt.store.get('h').blob, torch.Tensor)


@pytest.mark.parametrize('model', ['builtin:tiny-hybrid', 'builtin:tiny-lfm2'])
def test_fresh_capsule_meta_equals_its_parsed_json(make_runtime, model):
    # A snapshot primes the checked metadata a restore would parse from its JSON; both
    # must agree, or the first restore of a fresh capsule would differ from a later one.
    rt = make_runtime(model)
    rt.prefill(PROMPT)
    greedy(rt, 3)
    rt.snapshot('fresh', tier='host')
    cap = rt.store.get('fresh')
    primed = cap.restore_cache.pop('meta')
    parsed = rt.codec.check(cap)
    assert torch.equal(primed.pop('rng'), parsed.pop('rng'))
    assert primed == parsed and parsed['position'] == rt.position


def test_blob_pool_reuses_dropped_memory_but_never_memory_still_in_use():
    pool = BlobPool(idle_limit=1 << 20)
    a = pool.take(1000)
    first = a.data_ptr()
    del a
    b = pool.take(990)  # fits the idle buffer (at most 1/8 larger than asked)
    assert b.data_ptr() == first and b.numel() == 990
    view = b[10:20]
    view.fill_(7)
    del b
    c = pool.take(1000)  # the buffer is idle again, but a view of it is alive
    assert c.data_ptr() != first and int(view.sum()) == 70
    del c
    big = pool.take(4 << 20)
    del big  # larger than the idle limit: not kept
    assert pool.idle_bytes <= 1 << 20


def test_blob_pool_finalizer_inside_take_does_not_deadlock():
    """A garbage collection inside take() may run a blob's finalizer on the same thread."""
    pool = BlobPool(idle_limit=1 << 20)

    def gc_inside_take():
        with pool._lock:  # as take() holds it
            pool._give(torch.empty(10, dtype=torch.uint8))

    worker = threading.Thread(target=gc_inside_take, daemon=True)
    worker.start()
    worker.join(5.0)
    assert not worker.is_alive()
    assert pool.idle_bytes == 10


def test_repeated_snapshots_reuse_blob_memory_and_stay_exact(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    digest = rt.state_digest()
    ptrs = set()
    for _ in range(6):
        rt.snapshot('again')  # the new blob is taken before the old capsule is replaced
        ptrs.add(rt.store.get('again').blob.data_ptr())
    assert len(ptrs) == 2
    # the 4 dropped blobs came back to the pool; idle memory is bounded (2x the arena)
    assert 0 < rt.stats().blob_pool_idle_bytes <= 2 * rt.arena.nbytes
    greedy(rt, 4)
    rt.restore('again')  # the rollback ring now holds this capsule: its memory stays put
    assert rt.state_digest() == digest
    held = rt.ring[-1].blob.data_ptr()
    rt.snapshot('again')
    assert rt.store.get('again').blob.data_ptr() != held


def test_capsule_operations_from_many_threads_leave_every_capsule_intact(make_runtime):
    """
    Snapshots, restores, forks, deletes and rollbacks race a generating thread.

    No error but the expected ones; no capsule's bytes change after it was taken (some are
    sealed by verify_capsule mid-race: blob memory handed out twice would show); every
    capsule left restores to exactly what it holds.
    """
    rt = make_runtime(max_seq_len=1024, rollback_depth=4)
    rt.prefill(PROMPT)
    names = ['n0', 'n1', 'n2', 'n3']
    expected = (BusyError, CapsuleNotFoundError, InvalidNameError, InvalidRequestError)
    failures = []

    def generate():
        for _ in range(12):
            try:
                if rt.position > 900:
                    rt.reset()
                greedy(rt, 4, prompt='and')
            except expected:
                pass
            except Exception as exc:  # noqa: B902 - any other error is the finding
                failures.append(repr(exc))

    def operate(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(60):
            a, b = (names[int(i)] for i in torch.randint(0, len(names), (2,), generator=g))
            op = int(torch.randint(0, 10, (1,), generator=g))
            try:
                if op < 3:
                    rt.snapshot(a, tier=('device', 'host', 'disk')[seed % 3])
                elif op < 6:
                    rt.restore(a)
                elif op == 6:
                    rt.fork(a, b)
                elif op == 7:
                    rt.delete_capsule(a)
                elif op == 8:
                    rt.rollback(1)
                else:
                    rt.list_capsules()
                    rt.stats()
                    rt.verify_capsule(a)
            except expected:
                pass
            except Exception as exc:  # noqa: B902
                failures.append(repr(exc))

    threads = [threading.Thread(target=generate, daemon=True)] + [
        threading.Thread(target=operate, args=(seed,), daemon=True) for seed in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and failures == []
    left = [i.name for i in rt.list_capsules()]
    assert left
    for name in left:
        rt.verify_capsule(name)
        rt.restore(name)
        rt.snapshot('check')
        held, again = rt.store.get(name), rt.store.get('check')
        assert _blob_bytes(rt, name) == _blob_bytes(rt, 'check'), name
        assert json.loads(held.meta_json) == json.loads(again.meta_json), name
        rt.delete_capsule('check')
