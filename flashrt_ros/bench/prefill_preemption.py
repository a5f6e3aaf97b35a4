"""
Measure how long a preempting restore waits for a long prompt's prefill (models/pieces.py).

    python -m flashrt_ros.bench.prefill_preemption [--tokens 1024 4000] [--interrupts 60]

In one process, without ROS: a thread prefills a prompt of N token ids from a restored
capsule, and another restores the capsule with preempt=True at a random point of that
prefill. Interrupts alternate between the prefill in pieces (the default) and in whole
operations (Engine.prefill_pieces False), so both see the same machine. Prints, per prompt
length, the wait from the preemption armed to the prefill left and to the restore done
(median, p90, max, ms), and the uninterrupted prefill time of both, alternating too.
"""

import argparse
import random
import tempfile
import threading
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
from flashrt_ros.runtime.models.pieces import PIECE_ROWS
import numpy as np
import torch

QUANTILES = (50, 90, 100)


def _prefill(rt, ids, results=None):
    """Prefill `ids` (a turn of one token), as a turn thread would; append its result."""
    gen = rt.generate(prompt=ids, raw=True, max_new_tokens=1, stop=(), eos=False)
    for _ in gen:
        pass
    if results is not None:
        results.append(gen.result)


def _prefill_seconds(rt, ids, rounds):
    """Uninterrupted prefill seconds {pieces: [..]}, alternating between the two."""
    out = {True: [], False: []}
    for i in range(2 * rounds):
        rt.engine.prefill_pieces = pieces = i % 2 == 0
        rt.restore('home')
        t0 = time.perf_counter()
        _prefill(rt, ids)
        out[pieces].append(time.perf_counter() - t0)
    return out


def _interrupts(rt, ids, count, typical_s):
    """Preempt `count` prefills at random points; return {pieces: [(left, done) ms]}."""
    out = {True: [], False: []}
    missed = 0
    for i in range(count):
        rt.engine.prefill_pieces = pieces = i % 2 == 0
        rt.restore('home')
        results = []
        worker = threading.Thread(target=_prefill, args=(rt, ids, results))
        worker.start()
        time.sleep(random.uniform(0.1, 0.8) * typical_s)
        stages = {}
        rt.restore('home', preempt=True, stages=stages)
        returned = time.time()
        worker.join(60.0)
        # Counted only when the prefill was cut: no token came.
        if results and not results[0].token_ids and 'copied' in stages:
            left = stages['step_left'] - stages['armed']
            out[pieces].append((left * 1e3, (returned - stages['armed']) * 1e3))
        else:
            missed += 1
    return out, missed


def _row(label, values):
    q = np.percentile(values, QUANTILES) if len(values) else [float('nan')] * 3
    return f'{label:34s}' + ''.join(f'{v:9.2f}' for v in q) + f'   n {len(values)}'


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n')[0])
    p.add_argument('--model', default='default')
    p.add_argument('--tokens', type=int, nargs='+', default=[1024, 4000])
    p.add_argument('--interrupts', type=int, default=60, help='per length, half in pieces')
    p.add_argument('--rounds', type=int, default=4, help='uninterrupted prefills per side')
    p.add_argument('--threads', type=int, default=1, help='torch threads (default 1)')
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    longest = max(args.tokens)
    rt = Runtime(RuntimeConfig(model=args.model, capsule_dir=tempfile.mkdtemp(),
                               max_seq_len=longest + 64))
    try:
        rt.warmup()
        rt.snapshot('home', 'device')
        text = rt.tokenizer.encode('The arm moves the red cube onto the blue plate. ')
        ids = (text * (longest // len(text) + 1))[:longest]
        print(f'{args.model}, {args.threads} thread(s): ms from the preemption armed, '
              f'pieces of {PIECE_ROWS} rows vs whole operations')
        print(f'{"":34s}{"median":>9s}{"p90":>9s}{"max":>9s}')
        for n in args.tokens:
            seconds = _prefill_seconds(rt, ids[:n], args.rounds)
            typical = float(np.median(seconds[False]))
            waits, missed = _interrupts(rt, ids[:n], args.interrupts, typical)
            for pieces in (False, True):
                side = 'pieces' if pieces else 'whole '
                left = [w[0] for w in waits[pieces]]
                done = [w[1] for w in waits[pieces]]
                print(_row(f'{n} tokens {side}: prefill left', left))
                print(_row(f'{n} tokens {side}: restore done', done))
            whole, cut = (np.asarray([w[1] for w in waits[k]]) for k in (False, True))
            if len(whole) and len(cut):
                print(f'{n} tokens: restore done, whole / pieces: median '
                      f'{np.median(whole) / np.median(cut):.1f}x, max '
                      f'{whole.max() / cut.max():.1f}x; missed {missed}')
            on, off = np.median(seconds[True]), np.median(seconds[False])
            print(f'{n} tokens: uninterrupted prefill {off * 1e3:.1f} ms whole, '
                  f'{on * 1e3:.1f} ms in pieces ({on / off:.3f}x)')
    finally:
        rt.close()


if __name__ == '__main__':
    main()
