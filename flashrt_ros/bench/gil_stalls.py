"""
Find what holds the interpreter lock in a busy node, where an interrupt would wait for it.

    python -m flashrt_ros.bench.gil_stalls [--seconds 40] [--threshold-ms 4]

Starts `flashrt_node` (the default model, the robot settings) with a probe thread inside it:
under SCHED_FIFO 60 it sleeps 1 ms at a time, and each wake-up that comes late waited for
a CPU or for the interpreter lock. The same probe runs in a process of its own, which needs
no interpreter lock: what only the node's probe sees is the lock. Meanwhile turns are
interrupted every ~15 ms, ~/list_capsules is called at 20 Hz and every token chunk is
taken, as in fig5. A wake-up later than --threshold-ms dumps every thread's Python stack
(faulthandler, which needs no lock); the report names the frames that were running. The
dumps read the frames of threads that keep running, which now and then crashes the node
when they come often (a threshold of 1.5-2 ms did on 2 cores; the bench then says so).
Needs the right to use SCHED_FIFO (root, CAP_SYS_NICE or an rtprio limit).
"""

import argparse
import collections
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

PARAMS = {'model': 'default', 'control_priority': 50, 'compute_threads': 1,
          'token_chunk': 1, 'max_new_tokens': 200, 'diagnostics_period': 1.0}
PROMPT = 'Tell me about the red cup and the tray.'
# Frames of threads that wait without the interpreter lock: not the holder.
WAITING = ('in _worker', 'in wait', 'in _wait_for_ready_callbacks', 'in _wait_once',
           'in _loop', 'in _probe', 'in run\n')


def _probe(seconds, out, stacks=None, threshold_s=None, start=None):
    """Sleep 1 ms at a time under SCHED_FIFO 60; write the late wake-ups (ms) to `out`."""
    while start is not None and not os.path.exists(start):  # the load has begun
        time.sleep(0.01)
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(60))
    late, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        if stacks is not None:
            faulthandler.dump_traceback_later(threshold_s, file=stacks)
        t0 = time.perf_counter()
        time.sleep(0.001)
        late.append((time.perf_counter() - t0) * 1e3 - 1.0)
        if stacks is not None:
            faulthandler.cancel_dump_traceback_later()
    with open(out, 'w') as f:
        json.dump(late, f)


def _inside(args):
    """Run the node with the probe thread (this module run with --inside)."""
    stacks = open(args.stacks, 'w')
    threading.Thread(target=_probe, daemon=True, args=(
        args.seconds, args.out, stacks, args.threshold_ms / 1e3, args.start)).start()
    from flashrt_ros.node.main import main
    sys.argv = ['flashrt_node'] + args.ros_args
    sys.exit(main())


def _load(seconds, ready):
    """Interrupt turns, list capsules and take tokens until `seconds` have passed."""
    from flashrt_ros.client import FlashRTClient
    from flashrt_ros.msg import Interrupt
    client, lister = FlashRTClient('flashrt', timeout=30.0), FlashRTClient('flashrt')
    try:
        assert client.wait_until_active(180.0), 'the node did not become active'
        client.subscribe_tokens(lambda chunk: None)
        stop = threading.Event()

        def list_capsules():
            while not stop.wait(0.05):
                lister.list_capsules()
        threading.Thread(target=list_capsules, daemon=True).start()
        ready.set()
        end, turns = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            run = client.start_generate(PROMPT)
            time.sleep(0.015)
            client.interrupt(mode=Interrupt.RESTORE, capsule='home')
            run.result(30.0)
            turns += 1
        stop.set()
        return turns
    finally:
        client.close()
        lister.close()


def _node_ended(node, work):
    """Say so when the load failed because the node it loads has ended."""
    code = node.poll()
    if code is None:
        return
    why = (' (a signal: faulthandler reads the stacks of threads that keep running, which '
           'can crash the process; a higher --threshold-ms dumps less often)'
           if code < 0 else '')
    raise RuntimeError(f'the node ended with exit code {code} during the load{why}; its '
                       f'log and the stacks dumped are in {work}')


def _holders(path):
    """Count the innermost frames of the threads that were not waiting, over every dump."""
    counts = collections.Counter()
    dumps = open(path).read().split('Timeout (')[1:]
    for dump in dumps:
        for block in dump.split('\n\n'):
            frames = [line.strip() for line in block.splitlines()
                      if line.strip().startswith('File')]
            if frames and not any(w in frames[0] + '\n' for w in WAITING):
                counts[' <- '.join(f.split('site-packages/')[-1][:70] for f in frames[:3])] += 1
    return len(dumps), counts


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split('\n')[0])
    p.add_argument('--seconds', type=float, default=40.0)
    p.add_argument('--threshold-ms', type=float, default=4.0)
    p.add_argument('--inside', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--probe-only', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--out', help=argparse.SUPPRESS)
    p.add_argument('--stacks', help=argparse.SUPPRESS)
    p.add_argument('--start', help=argparse.SUPPRESS)
    args, ros_args = p.parse_known_args()  # --inside: the node's --ros-args ...
    args.ros_args = ros_args
    if args.inside:
        return _inside(args)
    if args.probe_only:
        return _probe(args.seconds, args.out)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError as exc:
        sys.exit(f'SCHED_FIFO refused ({exc}): run as root or grant CAP_SYS_NICE')
    work = tempfile.mkdtemp(prefix='gil_stalls_')
    params = os.path.join(work, 'params.yaml')
    with open(params, 'w') as f:
        f.write('flashrt:\n  ros__parameters:\n' + ''.join(
            f'    {k}: {json.dumps(v)}\n' for k, v in dict(
                PARAMS, capsule_dir=os.path.join(work, 'capsules')).items()))
    node_out, own_out = os.path.join(work, 'node.json'), os.path.join(work, 'own.json')
    stacks, start = os.path.join(work, 'stacks.txt'), os.path.join(work, 'start')
    ready, turns, failed = threading.Event(), [], []

    def load_node():
        try:
            turns.append(_load(args.seconds + 5.0, ready))
        except BaseException as exc:  # noqa: B902 - reported by the main thread
            failed.append(exc)
            ready.set()
    load = threading.Thread(target=load_node)
    node = subprocess.Popen(
        [sys.executable, '-m', 'flashrt_ros.bench.gil_stalls', '--inside', '--seconds',
         str(args.seconds), '--threshold-ms', str(args.threshold_ms), '--out', node_out,
         '--stacks', stacks, '--start', start, '--ros-args', '--params-file', params],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, 'node.log'), 'w'))
    try:
        load.start()
        if not ready.wait(240.0) or failed:
            raise RuntimeError(f'the load did not start: {failed or "timeout"}')
        open(start, 'w').close()  # both probes cover the same stretch of the load
        subprocess.run([sys.executable, '-m', 'flashrt_ros.bench.gil_stalls', '--probe-only',
                        '--seconds', str(args.seconds), '--out', own_out], check=True)
        load.join()
        if failed:
            _node_ended(node, work)
            raise failed[0]
        deadline = time.monotonic() + 30.0
        while not os.path.exists(node_out) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        node.send_signal(2)
        node.wait(30.0)
    for label, path in (('in the node', node_out), ('in a process of its own', own_out)):
        with open(path) as f:
            late = sorted(json.load(f))
        over = [x for x in late if x > args.threshold_ms]
        print(f'{label:24s} late wake-ups ms: median {late[len(late) // 2]:.3f} p99 '
              f'{late[int(len(late) * 0.99)]:.3f} max {late[-1]:.2f}; over '
              f'{args.threshold_ms} ms: {len(over)} of {len(late)}')
    dumps, counts = _holders(stacks)
    print(f'{turns[0] if turns else 0} interrupted turns; {dumps} stacks dumped in the node; '
          'running frames (innermost first):')
    for frames, n in counts.most_common(10):
        print(f'  {n:4d}  {frames}')


if __name__ == '__main__':
    main()
