"""The generated interfaces import from the installed package and travel over real DDS."""

import importlib.util
import threading

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec('rclpy') is None, reason='needs rclpy (run through `make test`)')

SERVICE_TYPES = ['Snapshot', 'Restore', 'Fork', 'Rollback', 'ListCapsules', 'DeleteCapsule',
                 'ExportManifest', 'ExportChunk']


def _spin_until(executor, done, timeout=10.0):
    import time
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    return done()


def test_generated_modules_live_beside_the_runtime():
    import flashrt_ros
    import flashrt_ros.msg
    import flashrt_ros.srv
    # The hand-written package and the generated interfaces are one installed package.
    assert flashrt_ros.msg.__file__.startswith(flashrt_ros.__path__[0])
    assert flashrt_ros.srv.__file__.startswith(flashrt_ros.__path__[0])


def test_message_constants_and_defaults():
    from flashrt_ros.action import Generate
    from flashrt_ros.msg import CapsuleInfo, Interrupt
    from flashrt_ros.srv import Restore
    modes = (Interrupt.POLICY, Interrupt.STOP, Interrupt.ROLLBACK, Interrupt.RESTORE)
    assert modes == (0, 1, 2, 3)
    assert Interrupt().mode == Interrupt.POLICY  # an empty message applies the node's policy
    assert {CapsuleInfo.TIER_DEVICE, CapsuleInfo.TIER_HOST, CapsuleInfo.TIER_DISK} == {
        'device', 'host', 'disk'}
    assert Restore.Request.MODE_KV_ONLY == 'kv_only'
    from flashrt_ros.msg import AudioChunk
    assert (AudioChunk.FORMAT_INT16, AudioChunk.FORMAT_FLOAT32) == ('int16', 'float32')
    goal = Generate.Goal()
    assert goal.seed == -1 and goal.raw is False
    # Sampling fields left unset mean the checkpoint's own defaults (generation_config.json).
    assert (goal.temperature, goal.top_k, goal.top_p) == (-1.0, -1, -1.0)
    info = CapsuleInfo()
    assert (info.roles, info.turns) == ([], 0)


@pytest.mark.parametrize('type_name', SERVICE_TYPES)
def test_service_round_trip_over_dds(ros_context, type_name):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    import flashrt_ros.srv
    srv_type = getattr(flashrt_ros.srv, type_name)
    node = rclpy.create_node(f'iface_test_{type_name.lower()}', context=ros_context)
    seen = []

    def handle(request, response):
        seen.append(request)
        response.success = True
        response.message = f'handled {type_name}'
        return response

    try:
        node.create_service(srv_type, f'~/{type_name.lower()}', handle)
        client = node.create_client(srv_type, f'~/{type_name.lower()}')
        executor = SingleThreadedExecutor(context=ros_context)
        executor.add_node(node)
        assert _spin_until(executor, lambda: client.service_is_ready()), 'service never appeared'
        request = srv_type.Request()
        first_field = next(iter(request.get_fields_and_field_types()))
        field_type = request.get_fields_and_field_types()[first_field]
        if field_type == 'string':
            setattr(request, first_field, 'home')
        future = client.call_async(request)
        assert _spin_until(executor, future.done), 'no response'
        response = future.result()
        assert response.success is True and response.message == f'handled {type_name}'
        assert len(seen) == 1
        if field_type == 'string':
            assert getattr(seen[0], first_field) == 'home'
        executor.shutdown()
    finally:
        node.destroy_node()


def test_token_chunk_published_and_received(ros_context):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from flashrt_ros.msg import CapsuleInfo, TokenChunk
    node = rclpy.create_node('iface_test_tokens', context=ros_context)
    received = []
    got = threading.Event()

    def on_chunk(msg):
        received.append(msg)
        got.set()

    try:
        node.create_subscription(TokenChunk, 'tokens', on_chunk, 10)
        pub = node.create_publisher(TokenChunk, 'tokens', 10)
        executor = SingleThreadedExecutor(context=ros_context)
        executor.add_node(node)
        assert _spin_until(executor, lambda: pub.get_subscription_count() > 0)
        msg = TokenChunk(turn_id=7, index=3, token_ids=[104, 105], text='hi', final=True,
                         stop_reason='eos')
        msg.header.stamp = node.get_clock().now().to_msg()
        pub.publish(msg)
        assert _spin_until(executor, got.is_set), 'TokenChunk never arrived'
        out = received[0]
        assert (out.turn_id, out.index, list(out.token_ids), out.text, out.final,
                out.stop_reason) == (7, 3, [104, 105], 'hi', True, 'eos')
        # Nested messages survive serialization too.
        info = CapsuleInfo(name='home', tier='device', size_bytes=1 << 40,
                           components=['kv', 'recurrent'])
        assert info.size_bytes == 1 << 40 and list(info.components) == ['kv', 'recurrent']
        executor.shutdown()
    finally:
        node.destroy_node()


def test_the_client_refuses_a_nul_byte_the_middleware_would_cut_at():
    from flashrt_ros.action import Generate, ImportCapsule
    from flashrt_ros.client import refuse_nul
    from flashrt_ros.msg import Interrupt
    from flashrt_ros.srv import Fork, Snapshot

    for msg in (Snapshot.Request(name='fz\0cut'), Fork.Request(source='a', target='b\0'),
                Interrupt(mode=Interrupt.RESTORE, capsule='home\0x'),
                ImportCapsule.Goal(source_node='/n', source_name='x\0y'),
                Generate.Goal(prompt='hi', stop=['ok', 'a\0b'])):
        with pytest.raises(ValueError, match='NUL byte'):
            refuse_nul(msg)
    refuse_nul(Snapshot.Request(name='fine'))  # nothing to refuse
    refuse_nul(Generate.Goal(prompt='hi', stop=['ok']))
