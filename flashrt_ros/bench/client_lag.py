"""
Measure how late FlashRTClient's callbacks run, against the client as it was.

    python -m flashrt_ros.bench.client_lag [--turns 60] [--tokens 8] [--against rclpy]

Starts `flashrt_node` (the default model); then, in blocks that alternate, the client as
shipped ('client') and, with --against rclpy, one spinning rclpy's MultiThreadedExecutor
instead of spin.PoolExecutor, or with --against undrained, one whose subscriptions take one
message per pass of the executor (no client.drain, rclpy's own feedback subscription at the
feedback's QoS) -- one client at a time: two in one process share the interpreter lock --
takes every ~/tokens chunk and sends goals with a feedback callback. A callback's lag is its
wall time minus the chunk's stamp (the node's clock, this host's). Prints median, p90, p99
and max of each, and the feedback chunks a client got from the node against those it
rebuilt from the result. A fast stream (--tokens 300) is where draining shows.
"""

import argparse
import contextlib
import tempfile
import time

import numpy as np

from .common import stamp_s

PARAMS = {'model': 'default', 'token_chunk': 1}
AGAINST = ('rclpy', 'undrained')
QUANTILES = (50, 90, 99, 100)


@contextlib.contextmanager
def _kind(kind):
    """Inside: FlashRTClient as `kind` ('client', or one of AGAINST) is made and runs."""
    from flashrt_ros import client as module
    from rclpy.executors import MultiThreadedExecutor

    saved = module.PoolExecutor, module.drain, module.UNUSED_FEEDBACK_QOS
    if kind == 'rclpy':
        module.PoolExecutor = MultiThreadedExecutor
    elif kind == 'undrained':
        module.drain = lambda subscription, message, deliver: deliver(message)
        module.UNUSED_FEEDBACK_QOS = module.FEEDBACK_QOS
    try:
        yield module.FlashRTClient
    finally:
        module.PoolExecutor, module.drain, module.UNUSED_FEEDBACK_QOS = saved


def _lag_ms(chunk):
    return (time.time() - stamp_s(chunk.header)) * 1e3


def _block(k, args, lag, stats, node):
    """Run one block of turns with a client of kind `k`; add to lag and stats."""
    with _kind(k) as make:
        _turns(make(timeout=30.0), k, args, lag, stats, node)


def _turns(client, k, args, lag, stats, node):
    try:
        if not client.wait_until_active(120.0):
            raise SystemExit('the node did not become active:\n' + node.log()[-2000:])
        sub = client.subscribe_tokens(lambda chunk: lag[k, 'tokens'].append(_lag_ms(chunk)))
        if not client.wait_for_publishers(sub):
            raise SystemExit('~/tokens did not match')
        for turn in range(args.turns // (2 * args.blocks)):
            chunks = []

            def on_chunk(chunk, chunks=chunks):
                chunks.append(chunk)
                if chunk.header.stamp.sec > 0:  # one rebuilt from the result has no stamp
                    lag[k, 'feedback'].append(_lag_ms(chunk))
            client.generate('Tell me about the arm.', max_new_tokens=args.tokens,
                            feedback_callback=on_chunk)
            stamped = sum(c.header.stamp.sec > 0 for c in chunks)
            stats[k]['sent'] += stamped
            stats[k]['rebuilt'] += len(chunks) - stamped
            time.sleep(0.05)
    finally:
        client.close()


def main():
    from flashrt_ros.node_process import NodeProcess

    p = argparse.ArgumentParser(description=__doc__.strip().split('\n')[0])
    p.add_argument('--turns', type=int, default=60, help='goals, half from each client')
    p.add_argument('--tokens', type=int, default=8, help='max_new_tokens of each goal')
    p.add_argument('--blocks', type=int, default=3, help='blocks of each client kind')
    p.add_argument('--against', choices=AGAINST, default='rclpy',
                   help='the client the shipped one is compared with (default %(default)s)')
    args = p.parse_args()
    kinds = (args.against, 'client')
    workdir = tempfile.mkdtemp(prefix='flashrt-client-lag-')
    node = NodeProcess(workdir, dict(PARAMS, capsule_dir=workdir))
    lag = {(k, kind): [] for k in kinds for kind in ('tokens', 'feedback')}
    stats = {k: {'sent': 0, 'rebuilt': 0} for k in kinds}
    try:
        for _ in range(args.blocks):
            for k in kinds:
                _block(k, args, lag, stats, node)
    finally:
        node.stop()
    print(f'callback lag after the chunk stamp, ms ({args.turns} turns of {args.tokens} '
          'tokens)')
    print(f'{"":26s}' + ''.join(f'{q:>9s}' for q in ('median', 'p90', 'p99', 'max')))
    for (k, kind), v in lag.items():
        q = np.percentile(v, QUANTILES) if v else [float('nan')] * 4
        print(f'{k + " " + kind:26s}' + ''.join(f'{x:9.2f}' for x in q) + f'   n {len(v)}')
    for k, s in stats.items():
        print(f'{k}: feedback chunks from the node {s["sent"]}, rebuilt from the result '
              f'{s["rebuilt"]}')


if __name__ == '__main__':
    main()
