"""
FlashRTClient's goal feedback when a chunk arrives after the result.

Feedback and result travel on different channels, so a chunk the node sent before its
result can be taken after it. Which comes first over DDS is chance; here a real rclpy
action server on the Generate interface sends the final chunk a moment after the result,
so the client meets that order every time.
"""

import threading
import time

from flashrt_ros.action import Generate
from flashrt_ros.client import FEEDBACK_QOS, FlashRTClient
from flashrt_ros.msg import TokenChunk
import rclpy
from rclpy.action import ActionServer
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor

NAME = 'late_feedback_server'
LATE_S = 0.1


def _chunk(index, final, node):
    chunk = TokenChunk(turn_id=7, index=index, token_ids=[] if final else [40 + index],
                       text='' if final else 'x', final=final,
                       stop_reason='max_tokens' if final else '')
    chunk.header.stamp = node.get_clock().now().to_msg()
    return chunk


def test_a_final_chunk_sent_after_the_result_still_reaches_the_callback():
    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node(NAME, context=context)
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

    server = ActionServer(node, Generate, f'/{NAME}/generate', execute,
                          feedback_pub_qos_profile=FEEDBACK_QOS)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
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
        executor.shutdown()
        server.destroy()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
