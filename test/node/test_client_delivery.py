"""
FlashRTClient against deliveries that DDS makes by chance, made here every time.

Real rclpy servers on the node's interfaces stand for the node: one sends a goal's final
chunk after its result (feedback and result travel on different channels, so that order
happens), one answers its first call after the client gave up waiting for it (as a reply
lost to discovery looks to the client).
"""

import threading
import time

from flashrt_ros.action import Generate
from flashrt_ros.client import FEEDBACK_QOS, FlashRTClient
from flashrt_ros.msg import TokenChunk
from flashrt_ros.srv import Snapshot
import pytest
import rclpy
from rclpy.action import ActionServer
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from std_srvs.srv import Trigger

NAME = 'late_feedback_server'
LATE_S = 0.1


def _chunk(index, final, node):
    chunk = TokenChunk(turn_id=7, index=index, token_ids=[] if final else [40 + index],
                       text='' if final else 'x', final=final,
                       stop_reason='max_tokens' if final else '')
    chunk.header.stamp = node.get_clock().now().to_msg()
    return chunk


@pytest.fixture
def server():
    """Yield an rclpy node named NAME spun on a thread of its own, in a context of its own."""
    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node(NAME, context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        yield node
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_a_final_chunk_sent_after_the_result_still_reaches_the_callback(server):
    node = server
    late = node.create_publisher(Generate.Impl.FeedbackMessage,
                                 f'/{NAME}/generate/_action/feedback', FEEDBACK_QOS)

    def execute(goal_handle):
        for i in range(3):
            goal_handle.publish_feedback(Generate.Feedback(chunk=_chunk(i, False, node)))
        message = Generate.Impl.FeedbackMessage(goal_id=goal_handle.goal_id)
        message.feedback.chunk = _chunk(3, True, node)

        def publish_late():
            time.sleep(LATE_S)  # the result is out by then
            late.publish(message)
        threading.Thread(target=publish_late, daemon=True).start()
        goal_handle.succeed()
        return Generate.Result(success=True, token_ids=[40, 41, 42], text='xxx',
                               stop_reason='max_tokens')

    action = ActionServer(node, Generate, f'/{NAME}/generate', execute,
                          feedback_pub_qos_profile=FEEDBACK_QOS)
    client = FlashRTClient(NAME, timeout=10.0)
    try:
        assert client.wait_for_publishers(client._generate_feedback.subscription)
        for turn in range(3):
            chunks = []
            outcome = client.generate('Go.', feedback_callback=chunks.append, timeout=10.0)
            assert outcome.result.success
            assert [c.index for c in chunks] == [0, 1, 2, 3], f'turn {turn}'
            # The node's own final chunk, stamped: not one rebuilt from the result.
            assert chunks[-1].final and chunks[-1].header.stamp.sec > 0, f'turn {turn}'
            assert outcome.chunks == chunks
    finally:
        client.close()
        action.destroy()


def test_goal_feedback_follows_a_remapped_action_name(server):
    """A remapping of ~/generate alone also moves the client's own feedback subscription."""
    def execute(goal_handle):
        for i, final in ((0, False), (1, False), (2, True)):
            goal_handle.publish_feedback(Generate.Feedback(chunk=_chunk(i, final, server)))
        goal_handle.succeed()
        return Generate.Result(success=True, token_ids=[40, 41], text='xx',
                               stop_reason='max_tokens')

    action = ActionServer(server, Generate, f'/{NAME}/generate', execute,
                          feedback_pub_qos_profile=FEEDBACK_QOS)
    context = Context()
    rclpy.init(context=context,
               args=['--ros-args', '-r', f'/elsewhere/generate:=/{NAME}/generate'])
    client = FlashRTClient('elsewhere', context=context, timeout=10.0)
    try:
        subscription = client._generate_feedback.subscription
        assert subscription.topic_name == f'/{NAME}/generate/_action/feedback'
        assert client.wait_for_publishers(subscription)
        chunks = []
        outcome = client.generate('Go.', feedback_callback=chunks.append, timeout=10.0)
        assert outcome.result.success
        assert [c.index for c in chunks] == [0, 1, 2] and chunks[-1].final
    finally:
        client.close()
        action.destroy()
        rclpy.try_shutdown(context=context)


def test_drain_delivers_what_waits_behind_a_message_in_order(server):
    """drain(): one callback delivers its message and every one queued behind it."""
    from flashrt_ros.client import drain, STREAM_QOS

    context = Context()
    rclpy.init(context=context)
    reader = rclpy.create_node('drain_reader', context=context)  # spun by no executor
    try:
        sub = reader.create_subscription(TokenChunk, '/drain_test', lambda m: None, STREAM_QOS)
        pub = server.create_publisher(TokenChunk, '/drain_test', STREAM_QOS)
        deadline = time.monotonic() + 10.0
        while sub.get_publisher_count() == 0 or pub.get_subscription_count() == 0:
            assert time.monotonic() < deadline, 'the test topic did not match'
            time.sleep(0.01)
        for i in range(6):
            pub.publish(_chunk(i, False, server))
        time.sleep(0.5)  # on one host the six are in the reader's queue well before this
        first = sub.handle.take_message(sub.msg_type, sub.raw)[0]
        delivered = []
        drain(sub, first, delivered.append)
        assert [m.index for m in delivered] == [0, 1, 2, 3, 4, 5]
        assert sub.handle.take_message(sub.msg_type, sub.raw) is None
        drain(None, first, delivered.append)  # a message taken before the subscription was
        assert len(delivered) == 7
    finally:
        reader.destroy_node()
        rclpy.try_shutdown(context=context)


def test_chunks_sent_before_the_reader_matched_reach_it(server):
    """
    A goal's chunks published before a client's feedback reader exists still reach it.

    A new client's reader can see the node's writer before the writer has seen the reader;
    what the node sends in between is what a reader made after it sees here.
    """
    from flashrt_ros.client import drained_subscription
    from unique_identifier_msgs.msg import UUID

    topic = f'/{NAME}/generate/_action/feedback'
    writer = server.create_publisher(Generate.Impl.FeedbackMessage, topic, FEEDBACK_QOS)
    goal = UUID(uuid=list(range(16)))
    for i in range(3):
        message = Generate.Impl.FeedbackMessage(goal_id=goal)
        message.feedback.chunk = _chunk(i, i == 2, server)
        writer.publish(message)
    context = Context()
    rclpy.init(context=context)
    reader = rclpy.create_node('late_reader', context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(reader)
    delivered = []
    try:
        drained_subscription(reader, Generate.Impl.FeedbackMessage, topic, delivered.append,
                             FEEDBACK_QOS)
        deadline = time.monotonic() + 10.0
        while len(delivered) < 3 and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        assert [(bytes(m.goal_id.uuid), m.feedback.chunk.index) for m in delivered] == [
            (bytes(range(16)), i) for i in range(3)]
    finally:
        executor.shutdown()
        reader.destroy_node()
        rclpy.try_shutdown(context=context)


def test_a_query_unanswered_is_sent_again_and_a_change_never(server, monkeypatch):
    """state_digest is sent again after RESEND_S; snapshot waits for its one answer."""
    from flashrt_ros import client as module
    monkeypatch.setattr(module, 'RESEND_S', 0.3)
    calls = {'state_digest': 0, 'snapshot': 0}

    def slow_first(name, response):
        def serve(request, reply):
            calls[name] += 1
            if calls[name] == 1:
                time.sleep(0.45)  # past RESEND_S: to the client, a reply that was lost
            for field, value in response.items():
                setattr(reply, field, value)
            return reply
        return serve

    server.create_service(Trigger, f'/{NAME}/state_digest',
                          slow_first('state_digest', {'success': True, 'message': 'ab' * 32}))
    server.create_service(Snapshot, f'/{NAME}/snapshot',
                          slow_first('snapshot', {'success': True, 'message': 'saved'}))
    client = FlashRTClient(NAME, timeout=5.0)
    try:
        assert client.state_digest() == 'ab' * 32
        assert calls['state_digest'] >= 2  # sent again, answered
        assert client.snapshot('a').message == 'saved'
        assert calls['snapshot'] == 1  # a change is sent once, however long it takes
    finally:
        client.close()
