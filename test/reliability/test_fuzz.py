"""Fuzz: every capsule service, the interrupt topic and the generate goal, seeded and bounded."""

import math
import random
import threading
import time

import pytest
from reliability_harness import HOME, POLICY_PARAMS, running_node, Surroundings
from reliability_harness import wait_restore_home
from test_soak import report

REQUESTS = 500
SEED = 17
VALID = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-'
NAMES = ['', 'a', 'x' * 128, 'x' * 129, 'x' * 1000, 'ab\0cd', '\0', 'ünïcødé', '日本語', '🤖',
         'a/b', '../x', '..', '.', '/etc/passwd', '..\\x', 'a b', ' ', '-', HOME, 'fz-1',
         'fz-2', 'model', 'stray']
TIERS = ['', 'device', 'host', 'disk', 'DISK', 'gpu', '\0', 'x' * 1000, 'dïsk', 'disk/..']
U32 = [0, 1, 2, 7, 2**31, 2**32 - 1]
FLOATS = [0.0, 0.5, 1.0, -1.0, 1.5, 1e30, math.nan, -math.inf]  # 1e-45, inf: below
TOKENS = [[], [65, 66], [263], [264], [-1], [2**31 - 1], [-2**31], [65] * 300]


def name(rng):
    """Return a boundary name or a random valid one."""
    if rng.random() < 0.3:
        return 'fz-' + ''.join(rng.choice(VALID) for _ in range(rng.randint(1, 12)))
    return rng.choice(NAMES)


def maybe(rng, default, values):
    """Return the field's default half of the time, else one of `values`."""
    return default if rng.random() < 0.5 else rng.choice(values)


class Interrupts:
    """Collect the node's interrupt events, to learn how each published interrupt ended."""

    def __init__(self, client):
        self.events, self._new = [], threading.Condition()
        self._sub = client.subscribe_events(self._add)
        assert client.wait_for_publishers(self._sub)  # or events are lost

    def _add(self, event):
        if event.operation == 'interrupt':
            with self._new:
                self.events.append(event)
                self._new.notify_all()

    def after(self, count, timeout=10.0):
        """Return the event after the first `count` ones (None if none within timeout)."""
        with self._new:
            self._new.wait_for(lambda: len(self.events) > count, timeout)
            return self.events[count] if len(self.events) > count else None


def send(client, interrupts, rng):
    """Send one random request; return (kind, request, refused, message)."""
    kind = rng.choice(['snapshot', 'restore', 'fork', 'rollback', 'list', 'delete',
                       'interrupt', 'goal'])
    if kind == 'snapshot':
        args = (name(rng), rng.choice(TIERS), rng.random() < 0.2)
        response = client.snapshot(*args)
    elif kind == 'restore':
        args = (name(rng), rng.choice(['', 'full', 'kv_only', 'FULL', 'x' * 300, '\0']))
        response = client.restore(*args)
    elif kind == 'fork':
        args = (name(rng), name(rng), rng.choice(TIERS))
        response = client.fork(*args)
    elif kind == 'rollback':
        args = (rng.choice(U32),)
        response = client.rollback(*args)
    elif kind == 'list':
        args = (rng.choice(TIERS),)
        response = client.list_capsules(*args)
    elif kind == 'delete':
        args = (name(rng),)
        response = client.delete_capsule(*args)
    elif kind == 'interrupt':
        mode = rng.randrange(256) if rng.random() < 0.5 else rng.randrange(5)
        args = (mode, rng.choice(U32), maybe(rng, '', NAMES), maybe(rng, '', NAMES))
        count = len(interrupts.events)
        client.interrupt(*args)
        event = interrupts.after(count)
        assert event is not None, f'no event for interrupt {args!r}'
        return kind, args, not event.success, event.message
    else:
        args = {'prompt': maybe(rng, 'hi', NAMES), 'token_ids': maybe(rng, [], TOKENS),
                'max_new_tokens': maybe(rng, 4, U32), 'temperature': maybe(rng, 0.0, FLOATS),
                'top_k': maybe(rng, 0, U32), 'top_p': maybe(rng, 1.0, FLOATS),
                'seed': maybe(rng, -1, [0, -2, 2**63 - 1, -2**63]),
                'stop': maybe(rng, [], [['\0'], ['x' * 1000], [''], ['🤖']]),
                'start_from': maybe(rng, '', NAMES),
                # bad save_as / save_tier values: test_goal_save_as_checked_before_turn
                'save_as': maybe(rng, '', ['fz-saved', HOME]),
                'save_tier': maybe(rng, '', ['device', 'host', 'disk'])}
        outcome = client.generate(timeout=60.0, **args)
        refused = not outcome.accepted or not outcome.result.success
        message = outcome.message if not outcome.accepted else outcome.result.message
        return kind, args, refused, message
    return kind, args, not response.success, response.message


@pytest.fixture(scope='module')
def node(tmp_path_factory):
    """Yield a client of one node for this module; its surroundings are checked at the end."""
    place = Surroundings(tmp_path_factory.mktemp('fuzz') / 'place')
    with running_node(tmp_path_factory.mktemp('node'), place.capsule_dir) as (proc, client):
        yield client
    place.assert_untouched()


def test_fuzz_services_interrupts_goals(node):
    rng = random.Random(SEED)
    counts, type_errors, client = {}, 0, node
    interrupts = Interrupts(client)
    digest, t0 = wait_restore_home(client), time.monotonic()
    for i in range(REQUESTS):
        if i % 25 == 0:  # back to a short state, so goals do not all end at max_seq_len
            digest = wait_restore_home(client)
        try:
            kind, args, refused, message = send(client, interrupts, rng)
        except (AssertionError, TypeError, ValueError) as exc:
            if 'no event for interrupt' in str(exc):
                raise
            type_errors += 1  # the message type itself refuses the value (client side)
            continue
        after = client.state_digest()  # the node answers
        key = (kind, 'refused' if refused else 'ok')
        counts[key] = counts.get(key, 0) + 1
        if refused:
            assert message, f'{kind} {args!r} refused with no message'
            assert after == digest, f'refused {kind} {args!r} changed the state: {message}'
        digest = after
    wall = time.monotonic() - t0
    refused = sum(n for (_, how), n in counts.items() if how == 'refused')
    report('fuzz', requests=REQUESTS, seed=SEED, refused=refused,
           answered_ok=REQUESTS - refused - type_errors, refused_by_message_type=type_errors,
           wall_s=round(wall, 1), by_kind={f'{k}/{h}': n for (k, h), n in sorted(counts.items())})


@pytest.mark.parametrize('save_as, save_tier', [('ünïcødé', ''), ('../x', 'disk'),
                                                ('fz-ok', 'gpu')])
def test_goal_save_as_checked_before_turn(node, save_as, save_tier):
    check_goal_refused(node, save_as=save_as, save_tier=save_tier)


def check_goal_refused(client, **goal):
    """Send a goal that must be refused; assert it was and that the state did not change."""
    digest = wait_restore_home(client)
    outcome = client.generate('hi', **{'max_new_tokens': 4, **goal})
    assert not outcome.accepted or not outcome.result.success, 'the goal was accepted and ran'
    assert client.state_digest() == digest, 'the refused goal changed the state'


@pytest.mark.parametrize('temperature', [1e-45, math.inf])
def test_goal_temperature_out_of_range_refused(node, temperature):
    check_goal_refused(node, temperature=temperature)


def test_nul_name_is_not_truncated(node):
    # The C layer cuts a name at a NUL before the node sees it ('fz\\0cut' would arrive as
    # 'fz'): the client refuses to send it (docs/security.md).
    with pytest.raises(ValueError, match='NUL byte'):
        node.snapshot('fz\0cut', 'disk')
    assert 'fz' not in [c.name for c in node.list_capsules().capsules]


OBSERVATION_SIZES = [0, 1, 3, 4, 5, 1000]  # tiny-policy takes 4
OBSERVATIONS = 120
RESENDS = 4


def test_fuzz_observations(tmp_path, surroundings):
    rng = random.Random(SEED)
    counts = {'refused': 0, 'stepped': 0, 'resent': 0}
    # Its own name: the module's language-model node is still up on this domain.
    with running_node(tmp_path / 'node', surroundings.capsule_dir, POLICY_PARAMS,
                      name='flashrt_policy') as (_, client):
        assert client.wait_for_subscribers(10.0, 'observation')
        outcomes, arrived = [], threading.Semaphore(0)

        def add(kind):
            def callback(message):
                if kind == 'actions' or message.operation == 'observation':
                    outcomes.append((kind, message))
                    arrived.release()
            return callback

        subs = [client.subscribe_events(add('event')), client.subscribe_actions(add('actions'))]
        assert client.wait_for_publishers(*subs)
        wait_restore_home(client)

        def settle():
            # A resent observation may be answered twice, late: let stragglers land.
            time.sleep(0.2)
            while arrived.acquire(timeout=0):
                pass

        for _ in range(OBSERVATIONS):
            values = [rng.choice([0.0, 0.5, -3.0, 1e38, math.nan, math.inf, -math.inf])
                      for _ in range(rng.choice(OBSERVATION_SIZES))]
            settle()
            start, before = len(outcomes), client.state_digest()
            # ~/observation* is BEST_EFFORT (sensor QoS): a message may be lost on the way;
            # send it again, a few times at most.
            for _ in range(RESENDS):
                client.publish_observation(values)
                if arrived.acquire(timeout=2.0):
                    break
                counts['resent'] += 1
            else:
                pytest.fail(f'no answer to observation {values[:8]!r} sent {RESENDS} times')
            settle()
            answers = outcomes[start:]
            if all(kind == 'event' for kind, _ in answers):
                counts['refused'] += 1
                assert client.state_digest() == before, (
                    f'refused observation changed the state: {answers[-1][1]}')
            else:
                counts['stepped'] += 1
        for sub in subs:
            client.node.destroy_subscription(sub)
    report('fuzz_observations', observations=OBSERVATIONS, **counts)
