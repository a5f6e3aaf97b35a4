"""Racing clients: four threads call every capsule service at once against one node."""

import random
import threading
import time

from reliability_harness import HOME, running_node, wait_restore_home
from test_soak import report

THREADS = 4
RUN_S = 20.0
NAMES = ['race-a', 'race-b', 'race-c', 'race-d', HOME, 'missing']
TIERS = ['device', 'host', 'disk', '']


def race(client, rng, stop_at, tally, failures):
    """Call random capsule services until stop_at; count answers, record anything else."""
    while time.monotonic() < stop_at:
        op = rng.choice(['snapshot', 'restore', 'fork', 'list', 'delete', 'digest'])
        name, other = rng.choice(NAMES), rng.choice(NAMES)
        try:
            if op == 'snapshot':
                response = client.snapshot(name, rng.choice(TIERS[:3]))
            elif op == 'restore':
                response = client.restore(name)
            elif op == 'fork':
                response = client.fork(name, other, rng.choice(TIERS))
            elif op == 'list':
                response = client.list_capsules(rng.choice(TIERS))
            elif op == 'delete':
                response = client.delete_capsule(name)
            else:
                client.state_digest()
                response = None
        except Exception as exc:  # a timeout, or a digest refused: not an answer
            failures.append(f'{op} at {stop_at - time.monotonic():.1f} s before the end: {exc!r}')
            continue
        ok = response is None or response.success
        if not ok and not response.message:
            failures.append(f'{op} {name!r}: refused with no message')
        tally[op, ok] = tally.get((op, ok), 0) + 1


def test_racing_clients(tmp_path, surroundings):
    with running_node(tmp_path / 'node', surroundings.capsule_dir) as (proc, client):
        from flashrt_ros.client import FlashRTClient
        wait_restore_home(client)
        clients = [FlashRTClient('flashrt', timeout=20.0) for _ in range(THREADS)]
        tallies, failures = [{} for _ in clients], []
        stop_at = time.monotonic() + RUN_S
        threads = [threading.Thread(target=race, args=(c, random.Random(i), stop_at, t,
                                                       failures))
                   for i, (c, t) in enumerate(zip(clients, tallies))]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(RUN_S + 60.0)
            assert not any(t.is_alive() for t in threads), 'a client is still waiting'
        finally:
            for c in clients:
                c.close()
        assert failures == []
        calls = sum(sum(t.values()) for t in tallies)
        refused = sum(n for t in tallies for (_, ok), n in t.items() if not ok)

        # Every capsule left restores, and a refusal leaves the state as it was.
        left = client.list_capsules()
        assert left.success, left.message
        for capsule in left.capsules:
            response = client.restore(capsule.name)
            assert response.success, f'{capsule.name} ({capsule.tier}): {response.message}'
        digest = client.state_digest()
        assert not client.restore('never-written').success
        assert client.state_digest() == digest
    report('racing_clients', threads=THREADS, seconds=RUN_S, calls=calls, refused=refused,
           capsules_left=len(left.capsules))
