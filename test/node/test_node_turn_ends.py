"""
The ROS side of the races at a turn's start and end, made certain by slowing the node.

The session layer's own tests (test/session) drive these races deterministically without
ROS; here the node runs in this process (its own context and executor, talking to the
client over DDS) to check what only the wiring decides: rclpy answering a goal before it
hands it over, marking a cancelled goal CANCELING late, the goal's final status, and the
lifecycle publisher that still carries a final chunk while deactivating. The slowing goes
through public seams: rclpy's action server callbacks and the node's session outputs.
"""

import time

from action_msgs.msg import GoalStatus
from flashrt_ros.msg import Interrupt
from node_harness import HOME, NODE_A_PARAMS, node_in_process
from node_harness import wait_until as _wait
import pytest
from rclpy.parameter import Parameter

NAME = 'flashrt_probe'
DELAY = 0.3  # seconds a slowed step takes
LONG_PROMPT = 'Describe the room.'  # runs to max_new_tokens from home (no early eos)


def _slow_down(node, delays):
    """Make the node's goal callbacks and final chunks sleep delays[<where>] seconds."""
    accepted, cancel = node._handle_accepted_callback, node._cancel_callback
    chunk = node.outputs.chunk

    def slow_accepted(goal_handle):
        time.sleep(delays['accepted'])  # rclpy has already answered the goal
        accepted(goal_handle)

    def slow_cancel(goal_handle):
        response = cancel(goal_handle)
        time.sleep(delays['cancel_return'])  # rclpy marks the goal CANCELING after this
        return response

    def slow_chunk(turn, index, ids, text, stop_reason, final=False):
        time.sleep(delays['before_final'] if final else 0.0)  # counted out, not yet done
        chunk(turn, index, ids, text, stop_reason, final)
        time.sleep(delays['after_final'] if final else 0.0)  # before the turn is done

    node._action_server.register_handle_accepted_callback(slow_accepted)
    node._action_server.register_cancel_callback(slow_cancel)
    node.outputs.chunk = slow_chunk


@pytest.fixture(scope='module')
def probe(tmp_path_factory):
    """Run a node in this process; yield (client, delays, node)."""
    params = dict(NODE_A_PARAMS, capsule_dir=str(tmp_path_factory.mktemp('probe_capsules')))
    delays = dict.fromkeys(('accepted', 'cancel_return', 'before_final', 'after_final'), 0.0)
    with node_in_process(NAME, params, lambda node: _slow_down(node, delays)) as (client, node):
        yield client, delays, node


@pytest.fixture
def slowed(probe):
    """Yield the probe's delays; reset them and go back home afterwards."""
    client, delays, _ = probe
    yield delays
    delays.update(dict.fromkeys(delays, 0.0))
    client.interrupt(mode=Interrupt.STOP, reason='next test')  # a failed test's turn
    assert _wait(lambda: client.restore(HOME).success)


def test_cancel_before_the_turn_is_registered(probe, slowed):
    """A cancel sent as soon as the goal is accepted ends it, even before its turn exists."""
    client, _, _ = probe
    slowed['accepted'] = DELAY
    run = client.start_generate(LONG_PROMPT, max_new_tokens=300)
    assert run.accepted
    response = run.cancel()
    assert len(response.goals_canceling) == 1, 'the cancel was refused'
    outcome = run.result(30.0)
    assert outcome.status == GoalStatus.STATUS_CANCELED
    assert outcome.result.stop_reason == 'interrupted' and not outcome.token_ids
    assert outcome.result.message == 'cancelled before it started'
    assert client.generate('Still free?', max_new_tokens=2).result.success


def test_cancel_queued_goal(probe, slowed):
    """A cancelled queued goal ends at once, as CANCELED even when rclpy marks it late."""
    client, _, node = probe
    node.set_parameters([Parameter('goal_policy', value='queue')])
    try:
        slowed['cancel_return'] = DELAY
        first = client.start_generate(LONG_PROMPT, max_new_tokens=600)
        assert first.accepted and _wait(lambda: len(first.chunks) >= 2)
        second = client.start_generate('Two.', max_new_tokens=5)
        assert second.accepted
        assert len(second.cancel().goals_canceling) == 1
        outcome = second.result(3.0)  # TimeoutError if it waits for the first turn
        assert outcome.status == GoalStatus.STATUS_CANCELED, outcome
        assert outcome.result.message == 'cancelled before it started'
        assert not first.chunks[-1].final, 'the first turn ended first'
        first.cancel()
        assert first.result(30.0).status == GoalStatus.STATUS_CANCELED
    finally:
        node.set_parameters([Parameter('goal_policy', value='reject')])


def test_cancel_after_the_final_chunk_is_refused(probe, slowed):
    """A turn that has said it is over stays as it ended: a late cancel cannot relabel it."""
    client, _, _ = probe
    slowed['after_final'] = DELAY
    run = client.start_generate('Short.', max_new_tokens=4)
    assert _wait(lambda: run.chunks and run.chunks[-1].final)
    response = run.cancel()
    assert not response.goals_canceling, 'a cancel after the final chunk was accepted'
    outcome = run.result(30.0)
    assert outcome.status == GoalStatus.STATUS_SUCCEEDED
    assert outcome.result.success and outcome.result.stop_reason == 'max_tokens'


@pytest.mark.parametrize('mode', [Interrupt.RESTORE, Interrupt.ROLLBACK])
def test_interrupt_event_comes_after_the_turn(probe, slowed, mode):
    """A client that chains a restore or a goal on the interrupt's event is not refused."""
    client, _, _ = probe
    events = []  # (receipt time, event)
    sub = client.subscribe_events(lambda e: events.append((time.time(), e)))
    assert client.wait_for_publishers(sub)
    try:
        slowed['before_final'] = DELAY  # the interrupted turn is slow to end
        run = client.start_generate(LONG_PROMPT, max_new_tokens=600)
        assert run.accepted and _wait(lambda: len(run.chunks) >= 2)
        client.interrupt(mode=mode, capsule=HOME, boundaries=1, reason='chained')
        assert _wait(lambda: any(e.operation == 'interrupt' for _, e in events))
        received, event = next((t, e) for t, e in events if e.operation == 'interrupt')
        assert event.success, event
        if mode == Interrupt.RESTORE:
            response = client.restore(HOME)
            assert response.success, response.message
        else:
            chained = client.start_generate('Next.', max_new_tokens=2)
            assert chained.accepted, 'the goal sent on the event was rejected'
            assert chained.result(30.0).result.success
        assert run.result(30.0).result.stop_reason == 'interrupted'
        # latency and stamp are those of the restore, not of the wait for the turn's end
        assert event.latency_ms < DELAY * 1e3
        stamp = event.header.stamp.sec + event.header.stamp.nanosec * 1e-9
        assert received - stamp > DELAY * 0.8
    finally:
        client.node.destroy_subscription(sub)


def test_deactivate_publishes_the_final_chunk(probe, slowed):
    """~/tokens gets the final chunk of a turn that a deactivate stops, or meets ending."""
    client, _, _ = probe
    tokens = []
    sub = client.subscribe_tokens(tokens.append)
    assert client.wait_for_publishers(sub)
    slowed['before_final'] = DELAY
    try:
        # 'ending': the turn is counted out and its final chunk waits when deactivate comes
        for start, reason in (('goal', 'interrupted'), ('prompt', 'interrupted'),
                              ('ending', 'max_tokens')):
            del tokens[:]
            if start == 'prompt':
                client.publish_prompt(LONG_PROMPT)
            else:
                run = client.start_generate(LONG_PROMPT if start == 'goal' else 'Go.',
                                            max_new_tokens=600 if start == 'goal' else 3)
                assert run.accepted
            assert _wait(lambda: len(tokens) >= (3 if start == 'ending' else 2))
            assert client.change_state('deactivate', timeout=30.0)
            assert _wait(lambda: any(c.final for c in tokens), 2.0), (
                f'{start} turn: no final chunk on ~/tokens')
            assert tokens[-1].final and tokens[-1].stop_reason == reason
            if start != 'prompt':
                assert run.result(30.0).chunks[-1].final
            assert client.change_state('activate', timeout=30.0)
    finally:
        client.node.destroy_subscription(sub)
        if client.get_state() != 'active':
            client.change_state('activate', timeout=30.0)
