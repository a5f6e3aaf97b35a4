"""
Measure what lending the control thread's priority to a preempted step does (writer.py).

    python -m flashrt_ros.bench.priority_lending [--busy-cores 2] [--interrupts 600]

As the node runs with the robot settings, in one process and without ROS: a generation
thread at nice -10 decodes the default model on the compiled CPU step (one compute thread,
the node's switch interval while decoding), and a SCHED_FIFO 50 thread restores a device
capsule with preempt=True a few milliseconds into each turn. Interrupts alternate between
lending on (the default) and off (WriterSlot.lend_after_s None), so both see the same
machine; --busy-cores unrelated processes at normal priority keep cores busy meanwhile.
Prints median, p90, p99 and max of each stage (ms after the preemption is armed) and the
off / on ratios. --polls alternates the decode step's last two polls (after its layers,
before the head; after its feed, before sampling) on and off instead, lending on both.
Needs the right to use SCHED_FIFO (root, CAP_SYS_NICE or an rtprio limit: docs/setup.md).
"""

import argparse
import os
import queue
import random
import sys
import tempfile
import threading
import time

from flashrt_ros.runtime import Runtime, RuntimeConfig
from flashrt_ros.runtime.models import cpu_step
from flashrt_ros.runtime.modes.lm import generation
from flashrt_ros.runtime.preemption import meet
from flashrt_ros.runtime.writer import LEND_AFTER_S
from flashrt_ros.session.turns import SWITCH_INTERVAL_DECODING_S
import numpy as np
import torch

from .common import busy_processes

PROMPT = 'Tell me about the arm and the table please.'
STAGES = ('step_left', 'copied', 'returned')


def _generations(rt, turns):
    """Decode one turn per (first, done) put on `turns` (None ends), as the node's thread."""
    os.setpriority(os.PRIO_PROCESS, 0, -10)
    while (events := turns.get()) is not None:
        first, done = events
        for _ in rt.generate(prompt=PROMPT, max_new_tokens=400, stop=(), eos=False):
            first.set()
        done.set()


def _interrupts(rt, turns, count, priority, setup, decoding, samples, refused):
    """
    Preempt `count` turns under SCHED_FIFO, setup(on) alternating; fill `samples`.

    decoding: a few ms after the turn's first token (as fig5), else after its start.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except OSError as exc:
        refused.append(exc)
        return
    for i in range(count):
        lend = i % 2 == 0
        setup(lend)
        first, done = threading.Event(), threading.Event()
        turns.put((first, done))
        if decoding:
            first.wait(30.0)
            time.sleep(random.uniform(0.0, 0.01))
        else:
            time.sleep(random.uniform(0.005, 0.02))  # into the turn, its prompt included
        stages = {}
        rt.restore('home', preempt=True, stages=stages)
        stages['returned'] = time.time()
        assert done.wait(30.0), 'the preempted turn did not end'
        if 'copied' in stages:
            samples[lend].append([(stages[s] - stages['armed']) * 1e3 for s in STAGES])


def _setup(rt, args):
    """Return setup(on): how an interrupt of the "on" or the "off" half runs."""
    after = args.lend_after_ms / 1e3
    against = None if args.against_ms is None else args.against_ms / 1e3

    def lending(on):
        rt.writer.lend_after_s = after if on else against

    def polls(on):
        rt.writer.lend_after_s = after
        cpu_step.meet = generation.meet = meet if on else (lambda: None)
    return polls if args.polls else lending


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n')[0])
    p.add_argument('--model', default='default')
    p.add_argument('--interrupts', type=int, default=600, help='half with lending, half off')
    p.add_argument('--busy-cores', type=int, default=os.cpu_count() or 1,
                   help='unrelated busy processes (default: one per core)')
    p.add_argument('--priority', type=int, default=50,
                   help='SCHED_FIFO priority of the control thread (default %(default)s)')
    p.add_argument('--lend-after-ms', type=float, default=LEND_AFTER_S * 1e3,
                   help='WriterSlot.lend_after_s of the interrupts with lending (default '
                        '%(default)s)')
    p.add_argument('--against-ms', type=float, default=None,
                   help='the other half lends after this many ms instead of never ("off")')
    p.add_argument('--decoding', action='store_true',
                   help="interrupt 0-10 ms after a turn's first token (as fig5), not 5-20 "
                        'ms after its start')
    p.add_argument('--polls', action='store_true',
                   help="alternate the step's last two polls on and off instead of lending")
    args = p.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_DECODING_S)  # as the node's while a turn decodes
    rt = Runtime(RuntimeConfig(model=args.model, capsule_dir=tempfile.mkdtemp()))
    rt.warmup()
    rt.snapshot('home', 'device')
    turns = queue.Queue()
    worker = threading.Thread(target=_generations, args=(rt, turns), daemon=True)
    worker.start()
    busy = busy_processes(args.busy_cores)
    samples, refused = {True: [], False: []}, []
    try:
        control = threading.Thread(target=_interrupts, args=(
            rt, turns, args.interrupts, args.priority, _setup(rt, args), args.decoding,
            samples, refused))
        control.start()
        control.join()
    finally:
        for proc in busy:
            proc.kill()
        turns.put(None)
        worker.join(30.0)
        rt.close()
    if refused:
        sys.exit(f'SCHED_FIFO refused ({refused[0]}): run as root or grant CAP_SYS_NICE')
    print(f'{args.model}, {args.interrupts} preempting restores, {args.busy_cores} busy '
          f'cores, control thread SCHED_FIFO {args.priority}, lending after '
          f'{args.lend_after_ms} ms; ms after armed:')
    print(f'{"":22s} {"median":>8s} {"p90":>8s} {"p99":>8s} {"max":>8s}')
    rows = {}
    for lend in (False, True):
        x = np.asarray(samples[lend])
        for k, stage in enumerate(STAGES):
            q = np.percentile(x[:, k], [50, 90, 99, 100])
            rows[lend, stage] = q
            print(f'{stage:9s} lend {"on " if lend else "off"}   '
                  + ' '.join(f'{v:8.3f}' for v in q) + f'   n {len(x)}')
    for stage in STAGES:
        off, on = rows[False, stage], rows[True, stage]
        print(f'{stage:9s} off / on    ' + ' '.join(f'{a / b:7.2f}x' for a, b in zip(off, on)))


if __name__ == '__main__':
    main()
