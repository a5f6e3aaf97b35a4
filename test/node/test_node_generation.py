"""The generate action, token streaming, interrupts and resets over real DDS."""

import threading
import time

from action_msgs.msg import GoalStatus
from flashrt_ros.msg import Interrupt
from node_harness import diagnostics, HOME, set_parameter, wait_until as _wait
import pytest
from rclpy.event_handler import PublisherEventCallbacks
from rclpy.qos import QoSProfile, ReliabilityPolicy

BUSY = 'a generation is running; cancel it or publish ~/interrupt'
LONG = 600  # tokens: a turn that is still running when the test acts on it
# (this prompt runs to max_new_tokens from home; 'Tell me a long story.' stops after 24)


def _start_long(client, **kwargs):
    run = client.start_generate('Describe the room.', max_new_tokens=LONG, **kwargs)
    assert run.accepted
    assert _wait(lambda: len(run.chunks) >= 2), 'no tokens streamed'
    return run


def _set_param(client, name, value):
    result = set_parameter(client, name, value)
    assert result.successful, result.reason


def test_generate_streams_tokens(client, at_home):
    streamed = []
    sub = client.subscribe_tokens(streamed.append)
    assert client.wait_for_publishers(sub)
    try:
        outcome = client.generate('Hello robot.', max_new_tokens=12)
        assert _wait(lambda: any(c.final for c in streamed))
    finally:
        client.node.destroy_subscription(sub)
    result = outcome.result
    assert outcome.status == GoalStatus.STATUS_SUCCEEDED
    assert result.success and result.stop_reason == 'max_tokens'
    assert len(result.token_ids) == 12
    assert result.time_to_first_token_ms > 0.0 and result.tokens_per_second > 0.0
    assert result.position == len('You are a helpful robot.') + len('Hello robot.') + 11
    feedback_ids = [t for c in outcome.chunks for t in c.token_ids]
    assert feedback_ids == list(result.token_ids)
    assert outcome.chunks[-1].final and outcome.chunks[-1].stop_reason == 'max_tokens'
    assert [c.index for c in outcome.chunks[:3]] == [0, 1, 2]
    turn = outcome.chunks[0].turn_id
    topic_ids = [t for c in streamed if c.turn_id == turn for t in c.token_ids]
    assert topic_ids == list(result.token_ids)


def test_token_chunking(client, at_home):
    _set_param(client, 'token_chunk', 4)
    try:
        outcome = client.generate('Chunks.', max_new_tokens=10)
    finally:
        _set_param(client, 'token_chunk', 1)
    sizes = [len(c.token_ids) for c in outcome.chunks]
    assert sizes == [4, 4, 2], sizes  # the final chunk carries the remainder
    assert outcome.chunks[-1].final and [c.index for c in outcome.chunks] == [0, 4, 8]
    assert [t for c in outcome.chunks for t in c.token_ids] == list(outcome.result.token_ids)


def test_restore_home_gives_identical_tokens(client, at_home):
    first = client.generate('Where is the cup?', max_new_tokens=10)
    assert client.restore(HOME).success
    assert client.state_digest() == at_home
    second = client.generate('Where is the cup?', max_new_tokens=10)
    assert first.token_ids == second.token_ids
    third = client.generate('Where is the cup?', start_from=HOME, max_new_tokens=10)
    assert third.token_ids == first.token_ids


def test_restore_during_generation_is_refused(client, at_home):
    run = _start_long(client)
    response = client.restore(HOME)
    assert not response.success and response.message == BUSY
    response = client.rollback(1)
    assert not response.success and response.message == BUSY
    snap = client.snapshot('mid_turn')  # taken at the next step boundary
    assert snap.success, snap.message
    assert client.list_capsules().success
    assert len(run.chunks) < LONG
    run.cancel()
    outcome = run.result(30.0)
    assert outcome.status == GoalStatus.STATUS_CANCELED
    assert outcome.result.stop_reason == 'interrupted'
    assert len(outcome.token_ids) < LONG
    # interrupt_policy of the test node is restore_home
    assert _wait(lambda: client.state_digest() == at_home, 5.0)
    assert client.delete_capsule('mid_turn').success


def test_cancel_stops_within_a_step(client, at_home, events):
    start = len(events.events)
    run = _start_long(client)
    run.cancel()
    t0 = time.monotonic()
    outcome = run.result(30.0)
    assert time.monotonic() - t0 < 5.0
    assert outcome.status == GoalStatus.STATUS_CANCELED
    assert outcome.chunks[-1].final and outcome.chunks[-1].stop_reason == 'interrupted'
    event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and event.success and 'restore_home' in event.message


def test_second_goal_rejected(client, at_home):
    run = _start_long(client)
    try:
        second = client.start_generate('Me too.', max_new_tokens=4)
        assert not second.accepted
        assert not second.result().accepted
    finally:
        run.cancel()
        run.result(30.0)


def test_goal_queue(client, at_home):
    _set_param(client, 'goal_policy', 'queue')
    try:
        first = client.start_generate('One.', max_new_tokens=30, start_from=HOME)
        second = client.start_generate('Two.', max_new_tokens=5, start_from=HOME)
        assert first.accepted and second.accepted
        one, two = first.result(30.0), second.result(30.0)
        assert one.result.success and two.result.success
        assert len(one.token_ids) == 30 and len(two.token_ids) == 5
        assert one.chunks[0].turn_id < two.chunks[0].turn_id
    finally:
        _set_param(client, 'goal_policy', 'reject')


def test_interrupt_restore_topic(client, at_home, events):
    start = len(events.events)
    run = _start_long(client)
    client.interrupt(mode=Interrupt.RESTORE, capsule=HOME, reason='barge-in')
    outcome = run.result(30.0)
    assert outcome.status == GoalStatus.STATUS_SUCCEEDED
    assert outcome.result.stop_reason == 'interrupted'
    event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and event.success, event
    assert event.name == HOME and 'barge-in' in event.message
    assert 0.0 < event.latency_ms < 2000.0
    assert event.position == len('You are a helpful robot.')
    assert client.state_digest() == at_home
    # Where its time went: each stage after the middleware's receipt (not after the
    # callback: the control path takes the message's info), in order, ending at 'published'
    # (after 'ended': the interrupted turn is over first).
    assert list(event.stage_names) == ['callback', 'checked', 'armed', 'step_left', 'copied',
                                       'restored', 'ended', 'published']
    stages = dict(zip(event.stage_names, event.stage_ms))
    assert 0.0 < stages['callback'] and list(event.stage_ms) == sorted(event.stage_ms)
    assert abs(stages['restored'] - event.latency_ms) < 1e-6
    values = diagnostics(client)
    assert 'interrupt_restored_ms' in values and int(values['interrupts_timed']) >= 1


def test_interrupt_stop_keeps_the_boundary(client, at_home, events):
    start = len(events.events)
    run = _start_long(client)
    client.interrupt(mode=Interrupt.STOP, reason='e-stop')
    outcome = run.result(30.0)
    assert outcome.result.stop_reason == 'interrupted'
    assert len(outcome.token_ids) < LONG
    event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and event.success
    assert event.position == outcome.result.position
    assert event.name == ''  # no capsule is involved in a STOP
    assert client.state_digest() != at_home


def test_interrupt_rollback(client, at_home, events):
    outcome = client.generate('Pick it up.', max_new_tokens=5)
    assert outcome.result.success
    start = len(events.events)
    client.interrupt(mode=Interrupt.ROLLBACK, boundaries=2)
    event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and event.success, event
    assert client.state_digest() == at_home


def test_interrupt_policy_from_parameter(client, at_home, events):
    client.generate('Something.', max_new_tokens=3)
    start = len(events.events)
    client.interrupt()  # POLICY -> restore_home on the test node
    event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and event.success and event.name == HOME
    assert client.state_digest() == at_home


def test_interrupt_bad_capsule_keeps_serving(client, at_home, events):
    client.generate('Something.', max_new_tokens=3)
    before = client.state_digest()
    start = len(events.events)
    client.interrupt(mode=Interrupt.RESTORE, capsule='nowhere')
    event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
    assert event is not None and not event.success and 'not found' in event.message
    client.interrupt(mode=99)
    event = events.wait_for(lambda e: e.operation == 'interrupt' and 'mode' in e.message,
                            start=start)
    assert event is not None and not event.success
    assert client.state_digest() == before
    assert client.generate('Still here?', max_new_tokens=2).result.success


def test_best_effort_interrupt_publisher_is_reported(client, node_a):
    # The one subscription with a QoS event handler: a mismatch would lose every interrupt.
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT)
    # No event handlers on this side: destroying a publisher while its own incompatible-QoS
    # event is being taken raises in the spinning thread (rclpy InvalidHandle).
    pub = client.node.create_publisher(
        Interrupt, f'{client.base}/interrupt', qos,
        event_callbacks=PublisherEventCallbacks(use_default_callbacks=False))
    try:
        assert _wait(lambda: 'none of its interrupts will arrive' in node_a.log()), \
            node_a.log()[-2000:]
    finally:
        client.node.destroy_publisher(pub)


def test_client_keeps_serving_after_a_callback_fails(client, at_home):
    fired = threading.Event()

    def fail():
        timer.cancel()
        fired.set()
        raise RuntimeError('a callback of the client node fails')

    timer = client.node.create_timer(0.01, fail)
    try:
        assert fired.wait(5.0)
        time.sleep(0.1)  # the executor has seen the error by now
        assert client.state_digest() == at_home  # still spinning: the call is answered
    finally:
        client.node.destroy_timer(timer)


def test_reset_topic(client, at_home, events):
    run = _start_long(client)
    start = len(events.events)
    client.reset()
    run.result(30.0)
    event = events.wait_for(lambda e: e.operation == 'reset', start=start)
    assert event is not None and event.success and event.name == HOME
    assert event.latency_ms > 0.0
    assert client.state_digest() == at_home
    client.generate('More.', max_new_tokens=3)
    start = len(events.events)
    client.reset()
    assert events.wait_for(lambda e: e.operation == 'reset', start=start) is not None
    assert client.state_digest() == at_home


def test_prompt_topic(client, at_home):
    streamed = []
    sub = client.subscribe_tokens(streamed.append)
    assert client.wait_for_publishers(sub)
    try:
        client.publish_prompt('Where am I?')
        assert _wait(lambda: any(c.final for c in streamed), 20.0)
    finally:
        client.node.destroy_subscription(sub)
    ids = [t for c in streamed for t in c.token_ids]
    assert len(ids) == 16  # the node's max_new_tokens parameter
    assert streamed[-1].stop_reason == 'max_tokens'
    assert client.state_digest() != at_home


def test_service_call_from_token_callback(client, at_home):
    answers = []

    def on_chunk(chunk):
        if chunk.index == 1:  # call services synchronously from inside the callback
            answers.append(client.snapshot('from_callback'))
            answers.append(client.restore(HOME))
            answers.append(client.list_capsules())

    # A turn of LONG tokens: still running when the callback's calls reach the node.
    outcome = client.generate('Describe the room.', max_new_tokens=LONG,
                              feedback_callback=on_chunk, timeout=30.0)
    assert outcome.result.success
    assert len(answers) == 3
    assert answers[0].success and not answers[1].success and answers[2].success
    assert answers[1].message == BUSY
    assert client.delete_capsule('from_callback').success


def test_start_from_and_save_as(client, at_home):
    outcome = client.generate('Remember this.', start_from=HOME, save_as='remembered',
                              max_new_tokens=4)
    assert outcome.result.success, outcome.message
    listed = {c.name: c for c in client.list_capsules().capsules}
    assert listed['remembered'].position == outcome.result.position
    missing = client.generate('x', start_from='nowhere', max_new_tokens=4)
    assert missing.status == GoalStatus.STATUS_ABORTED
    assert not missing.result.success and 'not found' in missing.result.message
    assert missing.result.stop_reason == 'error'
    bad_save = client.generate('x', save_as='../bad', max_new_tokens=2)
    assert not bad_save.result.success and 'save_as' in bad_save.result.message
    assert client.delete_capsule('remembered').success


def test_final_chunk_ends_the_turn(client, at_home):
    """A client that acts on the final chunk finds the turn's work done and the node free."""
    streamed, answers = [], []
    sub = client.subscribe_tokens(streamed.append)
    assert client.wait_for_publishers(sub)

    def on_chunk(chunk):
        if not chunk.final:
            return
        # Chain the next step at once, as a robot stack would: restore what the turn saved
        # (save_as, on disk), or start the next turn on ~/prompt (goal_policy reject).
        if len(answers) % 2 == 0:
            try:
                answers.append(client.restore('chained'))
            except Exception as exc:
                answers.append(exc)
        else:
            client.publish_prompt('Next.')
            answers.append('prompt')

    try:
        for i in range(6):  # the node finished the turn before it said so, every time
            outcome = client.generate('First.', max_new_tokens=4, save_as='chained',
                                      save_tier='disk', feedback_callback=on_chunk,
                                      timeout=30.0)
            assert outcome.result.success, outcome.result.message
            # The callback may still be running when result() returns.
            assert _wait(lambda: len(answers) == i + 1, 10.0)
            if i % 2 == 0:
                assert answers[i].success, answers[i]
                continue
            turn = outcome.chunks[-1].turn_id
            assert _wait(lambda: any(c.final and c.turn_id > turn for c in streamed), 10.0), (
                f'turn {i}: the ~/prompt published on the final chunk was refused')
            chained = [c for c in streamed if c.turn_id > turn]
            assert chained[-1].stop_reason in ('max_tokens', 'eos')
    finally:
        client.node.destroy_subscription(sub)
        assert client.delete_capsule('chained').success


@pytest.mark.parametrize('kwargs, words', [
    ({'top_p': 0.0}, 'top_p'),
    ({'token_ids': [100000]}, 'vocabulary'),
])
def test_bad_goal_is_reported(client, at_home, kwargs, words):
    outcome = client.generate('x', max_new_tokens=2, **kwargs)
    assert not outcome.result.success and words in outcome.result.message
    assert client.state_digest() == at_home
    assert client.generate('ok', max_new_tokens=2).result.success


def test_generation_survives_parallel_queries(client, at_home):
    run = _start_long(client)
    digests, errors = [], []

    def query():
        try:
            for _ in range(5):
                digests.append(client.state_digest())
                assert client.list_capsules().success
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=query)
    thread.start()
    thread.join(30)
    run.cancel()
    run.result(30.0)
    assert not errors and len(digests) == 5
    assert len(set(digests)) > 1  # each digest is a different step boundary


@pytest.mark.parametrize('replace', ['interrupt', 'reset'])
def test_replaced_state_is_not_saved_as(client, at_home, replace):
    """A turn whose state an interrupt or reset replaced does not save_as the new state."""
    run = _start_long(client, save_as='replaced')
    if replace == 'interrupt':
        client.interrupt(mode=Interrupt.RESTORE, capsule=HOME, reason='barge-in')
        says = "an interrupt restored 'home'"
    else:
        client.reset()
        says = "a reset restored 'home'"
    outcome = run.result(30.0)
    assert outcome.status == GoalStatus.STATUS_ABORTED
    assert not outcome.result.success and outcome.result.stop_reason == 'interrupted'
    assert f"save_as 'replaced' skipped: {says} during the turn" in outcome.result.message
    assert 'replaced' not in {c.name for c in client.list_capsules().capsules}
    assert client.state_digest() == at_home


def test_client_callbacks_one_at_a_time_in_order(client, at_home):
    """A consumer that takes a few ms per chunk sees ~/tokens and the feedback in order."""
    seen = {'tokens': [], 'feedback': []}
    inside = {'tokens': 0, 'feedback': 0}
    most = {'tokens': 0, 'feedback': 0}
    lock = threading.Lock()

    def consumer(kind):
        def consume(chunk):
            with lock:
                inside[kind] += 1
                most[kind] = max(most[kind], inside[kind])
            seen[kind].append((chunk.turn_id, chunk.index))
            time.sleep(0.004)  # speech synthesis, a UI update
            with lock:
                inside[kind] -= 1
        return consume

    sub = client.subscribe_tokens(consumer('tokens'))
    assert client.wait_for_publishers(sub)  # matched: no chunk is missed
    try:
        outcome = client.generate('Go.', max_new_tokens=60, feedback_callback=consumer('feedback'),
                                  timeout=60.0)
        assert _wait(lambda: len(seen['tokens']) >= 61 and len(seen['feedback']) >= 61), (
            {kind: [index for _, index in chunks] for kind, chunks in seen.items()})
    finally:
        client.node.destroy_subscription(sub)
    assert len(outcome.token_ids) == 60
    for kind in ('tokens', 'feedback'):
        assert seen[kind] == sorted(seen[kind]), f'{kind} out of order'
        assert most[kind] == 1, f'{kind}: {most[kind]} callbacks at once'


def test_every_feedback_chunk_arrives_even_when_the_result_comes_first(client, at_home):
    """
    No feedback chunk is dropped or rebuilt from the result (a rebuilt one has no stamp).

    rclpy's action client forgets a goal's feedback callback when the result arrives, so a
    chunk taken after it was lost; the client takes the feedback itself (GoalFeedback).
    """
    for turn in range(60):  # short turns: the last chunk and the result go out together
        chunks = []
        outcome = client.generate('Go.', max_new_tokens=1, feedback_callback=chunks.append)
        assert outcome.result.success
        tokens = len(outcome.token_ids)  # a chunk per token, then the final one
        assert [c.index for c in chunks] == list(range(tokens + 1)), f'turn {turn}'
        assert chunks[-1].final and not any(c.final for c in chunks[:-1]), f'turn {turn}'
        assert all(c.header.stamp.sec > 0 for c in chunks), f'turn {turn}: a chunk rebuilt'


def test_goal_sent_from_feedback_callback(client, at_home):
    """A feedback callback may send the next goal (it does not block the action client)."""
    chained = []

    def on_chunk(chunk):
        if chunk.final and not chained:
            chained.append(client.start_generate('Next.', max_new_tokens=2, timeout=5.0))

    outcome = client.generate('First.', max_new_tokens=3, feedback_callback=on_chunk)
    assert outcome.result.success
    assert _wait(lambda: chained, 10.0)
    assert chained[0].accepted
    assert chained[0].result(30.0).result.success


def test_result_returns_after_every_feedback_callback(client, at_home):
    seen = []

    def slow(chunk):
        time.sleep(0.02)  # a consumer slower than the stream
        seen.append(chunk.index)

    outcome = client.generate('Go.', max_new_tokens=12, feedback_callback=slow)
    assert len(seen) == len(outcome.chunks) and outcome.chunks[-1].final
