"""
Measure how late FlashRTClient's callbacks run: rclpy's executor against spin.PoolExecutor.

    python -m flashrt_ros.bench.client_lag [--turns 60] [--tokens 8]

Starts `flashrt_node` (the default model); then, in blocks that alternate, a client
spinning rclpy's MultiThreadedExecutor or one spinning the PoolExecutor the client uses
(one at a time: two in one process share the interpreter lock) takes every ~/tokens chunk
and sends goals with a feedback callback. A callback's lag is its wall time minus the
chunk's stamp (the node's clock, this host's). Prints median, p90, p99 and max of each, and
the feedback chunks a client got from the node against those it rebuilt from the result.
"""

import argparse
import tempfile
import time

import numpy as np

from .common import stamp_s

PARAMS = {'model': 'default', 'token_chunk': 1}
KINDS = ('rclpy', 'pool')
QUANTILES = (50, 90, 99, 100)


def _client(pool):
    from flashrt_ros import client as module
    from rclpy.executors import MultiThreadedExecutor

    if pool:
        return module.FlashRTClient(timeout=30.0)
    plain, module.PoolExecutor = module.PoolExecutor, MultiThreadedExecutor
    try:
        return module.FlashRTClient(timeout=30.0)
    finally:
        module.PoolExecutor = plain


def _lag_ms(chunk):
    return (time.time() - stamp_s(chunk.header)) * 1e3


def _block(k, args, lag, stats, node):
    """Run one block of turns with a client of kind `k`; add to lag and stats."""
    client = _client(k == 'pool')
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
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix='flashrt-client-lag-')
    node = NodeProcess(workdir, dict(PARAMS, capsule_dir=workdir))
    lag = {(k, kind): [] for k in KINDS for kind in ('tokens', 'feedback')}
    stats = {k: {'sent': 0, 'rebuilt': 0} for k in KINDS}
    try:
        for _ in range(args.blocks):
            for k in KINDS:
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
