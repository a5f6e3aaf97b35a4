"""
Measure how low a full device restore can go behind a Python call (CPU, fig1 state).

    python -m flashrt_ros.bench.restore_floor [--position 64] [--rounds 300]

Runs fig1's device round (snapshot, raw copy, restores, lineage forgotten before the
timed full restore, raw copy) and times, in the same rounds, each after a restore of the
same capsule and a forgotten lineage, as fig1's full restore runs:
  restore    Runtime.restore(name): the full restore the target is about;
  floor      the restore cut down to what no restore can leave out: the copy, the adapter's
             layer flags, the sampler state, position and pending token, the rollback-ring
             append and the result; no checks, no lineage, no timing of its own;
  copy       the restore's copy alone, through the same views.
Each is reported as its median over the raw copy's median (a `copy_` of as many bytes).
The floor reaches into the runtime's internals on purpose: it is a measurement, not an API.
"""

import argparse
import itertools
import statistics
import tempfile
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig

from .measure import BENCH_MODEL, raw_copy, sample_interleaved_s, token_ids


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n')[0])
    p.add_argument('--position', type=int, default=64,
                   help='tokens prefilled, at least 1 (fig1: 64)')
    p.add_argument('--rounds', type=int, default=300)
    p.add_argument('--model', default=BENCH_MODEL)
    args = p.parse_args()
    if args.position < 1:
        p.error('--position must be at least 1 (a full restore copies the used rows)')
    rt = Runtime(RuntimeConfig(
        model=args.model, device='cpu', max_seq_len=16384 + 128, device_budget_bytes=0,
        host_budget_bytes=0, disk_budget_bytes=0, capsule_dir=tempfile.mkdtemp()))
    rt.warmup()
    rt.prefill(token_ids(args.position, seed=11))
    name = 'floor'
    rt.snapshot(name, 'device')
    # Each round's snapshot makes a new capsule; its first full restore (after a forgotten
    # lineage) checks it and caches the full-copy views that floor() and copy() use.
    nbytes = rt.store.get(name).nbytes
    raw = raw_copy(nbytes, 'cpu', 'cpu')
    epochs = itertools.count(1 << 40)

    def floor():
        t0 = time.perf_counter()
        cap = rt.store._mem[name]
        meta = cap.restore_cache['meta']
        with rt.writer.lock:
            dst, src = cap.restore_cache['prefix']
            dst.copy_(src)
            rt.arena.epoch = next(epochs)
            rt.adapter.import_meta(meta['adapter'])
            rt.generator.set_state(meta['rng'])
            rt.cursor.position, rt.cursor.pending = meta['position'], meta['pending']
            rt.ring.append(cap)
            return cap.info(time.perf_counter() - t0)

    def copy():
        dst, src = rt.store._mem[name].restore_cache['prefix']
        dst.copy_(src)

    forget, restore = rt.arena.begin_epoch, lambda: rt.restore(name)
    times = sample_interleaved_s(
        [lambda: rt.snapshot(name, 'device'), raw, restore, restore, forget, restore, forget,
         restore, raw, restore, forget, floor, raw, restore, forget, copy, raw],
        args.rounds, rt.device)
    m = [statistics.median(t) * 1e6 for t in times]
    print(f'{nbytes / 2**20:.2f} MiB, {args.rounds} rounds, median us (x raw copy_):')
    for label, ours, base in (('restore', 7, 8), ('floor', 11, 12), ('copy', 15, 16)):
        print(f'  {label:8s} {m[ours]:7.1f}  raw {m[base]:7.1f}  {m[ours] / m[base]:.3f}x')
    rt.close()


if __name__ == '__main__':
    main()
