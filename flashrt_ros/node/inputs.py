"""
Each mode's ROS inputs, subscribed on configure and destroyed on cleanup.

Observations in policy mode, audio in speech mode, none in LM mode (its
~/prompt and ~/generate belong to the node). A callback converts the message and hands it
to the session's mode; while the node is not active it says why the input was ignored.
"""

import functools

from flashrt_ros.msg import AudioChunk
from flashrt_ros.qos import AUDIO_QOS, COMMAND_QOS, IMAGE_QOS, INSTRUCTION_QOS, OBSERVATION_QOS
from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.modes.policy import image_from_bytes, IMAGE_PREFIX, STATE_KEY
import numpy as np
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Empty, Float32MultiArray, Int16MultiArray, String

from . import messages
from .control import received_time, with_info


class ModeInputs:
    """The subscriptions of one mode; `what` names its input in the log."""

    what = 'input'

    def __init__(self, node, mode, group):
        self._node, self._mode, self._group = node, mode, group
        self._subscriptions = []

    def _subscribe(self, msg_type, topic, callback, qos):
        self._subscriptions.append(self._node.create_subscription(
            msg_type, topic, with_info(callback), qos, callback_group=self._group))

    def _taking(self):
        """Return the mode if the node is active, else None (and say why, throttled)."""
        if self._node.active:
            return self._mode
        self._node.outputs.log('warning', f'{self.what} ignored: '
                               f'{self._node.not_active_message()}', throttle_s=5.0)
        return None

    def destroy(self):
        for sub in self._subscriptions:
            self._node.destroy_subscription(sub)
        self._subscriptions = []


class ObservationInputs(ModeInputs):
    """
    Take ~/observation, ~/observation_vector and one sensor_msgs/Image topic per camera.

    ~/observation is a JointState read by the policy's observation_names; the cameras' topics
    come from image_topics.

    Each input goes to the mode's stamp matching (session/sync.py) with its header stamp (an
    unstamped message, and a Float32MultiArray, get the time it was taken).
    """

    what = 'observation'

    def __init__(self, node, mode, group):
        super().__init__(node, mode, group)
        self.image_topics = image_topics(mode.image_keys, node.get_parameter(
            'image_topics').value)  # first: a bad entry fails before anything is subscribed
        self._subscribe(JointState, '~/observation', self._joint_state, OBSERVATION_QOS)
        self._subscribe(Float32MultiArray, '~/observation_vector', self._vector,
                        OBSERVATION_QOS)
        shapes = dict(mode.runtime.policy_spec.images)
        for key, topic in self.image_topics.items():
            self._subscribe(Image, topic, functools.partial(self._image, key, shapes[key]),
                            IMAGE_QOS)
        if mode.takes_instruction:
            self._subscribe(String, '~/instruction', self._instruction, INSTRUCTION_QOS)

    def _instruction(self, msg, msg_info):
        """Give a VLA its instruction (kept for activation while the node is inactive)."""
        self._mode.instruct(msg.data, active=self._node.active)

    def _observe(self, mode, key, value, header, msg_info):
        now = self._node.get_clock().now().nanoseconds
        stamp = messages.nanoseconds_of(header.stamp) if header is not None else 0
        mode.observe_input(key, value, stamp or now, received_time(msg_info), now)

    def _joint_state(self, msg, msg_info):
        mode = self._taking()
        if mode is None:
            return
        try:
            values = messages.joint_state_vector(msg, mode.observation_names)
        except ValueError as exc:
            mode.reject_observation(str(exc))
            return
        self._observe(mode, STATE_KEY, values, msg.header, msg_info)

    def _vector(self, msg, msg_info):
        mode = self._taking()
        if mode is not None:
            self._observe(mode, STATE_KEY, list(msg.data), None, msg_info)

    def _image(self, key, shape, msg, msg_info):
        mode = self._taking()
        if mode is None:
            return
        try:
            image = image_from_bytes(msg.data, msg.height, msg.width, msg.encoding, msg.step,
                                     shape)
        except InvalidRequestError as exc:
            mode.reject_observation(f'{key}: {exc}', key=key)
            return
        self._observe(mode, key, image, msg.header, msg_info)


def image_topics(keys, entries):
    """Map each camera key to its topic: '<camera>=<topic>' entries, else ~/image/<camera>."""
    cameras = {key[len(IMAGE_PREFIX):]: key for key in keys}
    topics = {key: f'~/image/{camera}' for camera, key in cameras.items()}
    for entry in entries:
        camera, sep, topic = entry.partition('=')
        if not sep or not topic or camera not in cameras:
            raise ValueError(f'image_topics entry {entry!r} is not <camera>=<topic> with a '
                             f'camera of this policy ({", ".join(cameras) or "none"})')
        topics[cameras[camera]] = topic
    return topics


class AudioInputs(ModeInputs):
    """~/audio, ~/audio_int16, ~/audio_float32, audio_common_msgs (if installed), ~/flush."""

    what = 'audio'

    def __init__(self, node, mode, group):
        super().__init__(node, mode, group)
        self._subscribe(AudioChunk, '~/audio', self._audio, AUDIO_QOS)
        self._subscribe(Int16MultiArray, '~/audio_int16',
                        functools.partial(self._raw, np.int16), AUDIO_QOS)
        self._subscribe(Float32MultiArray, '~/audio_float32',
                        functools.partial(self._raw, np.float32), AUDIO_QOS)
        self._subscribe(Empty, '~/flush', lambda msg, msg_info: self._flush(), COMMAND_QOS)
        self._subscribe_audio_common()

    def _audio(self, msg, msg_info):
        """Feed an AudioChunk (its rate, format and sample index checked)."""
        mode = self._taking()
        if mode is None:
            return
        try:
            samples = messages.audio_samples(msg)
        except ValueError as exc:
            mode.reject_audio(str(exc))
            return
        stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
        mode.audio(samples, msg.sample_rate, msg.first_sample, received_time(msg_info),
                   stamp or None)  # an unstamped chunk: the transcript is stamped when sent

    def _raw(self, dtype, msg, msg_info):
        """Feed mono samples at the model's rate (not numbered: no gap check)."""
        mode = self._taking()
        if mode is not None:
            mode.audio(np.asarray(msg.data, dtype=dtype), None, -1, received_time(msg_info))

    def _flush(self):
        """Publish the words the text delay still holds back (final transcript chunk)."""
        mode = self._taking()
        if mode is None:
            return
        try:
            mode.flush()
        except Exception as exc:
            mode.reject_audio(f'flush failed: {exc}')

    def _subscribe_audio_common(self):
        """Take audio_common_msgs audio too, of whichever flavour is installed (if any)."""
        try:
            import audio_common_msgs.msg as audio_common
        except ImportError:  # neither package is on the Python package index
            return
        logger = self._node.get_logger()
        flavour = messages.audio_common_flavour(audio_common)
        if not flavour:
            logger.warning('audio_common_msgs has neither the AudioStamped of '
                           'mgonzs13/audio_common nor the AudioData of '
                           'ros-drivers/audio_common; not subscribed to it')
            return
        msg_type, topic = ((audio_common.AudioStamped, '~/audio_stamped') if flavour == 'typed'
                           else (audio_common.AudioData, '~/audio_data'))
        self._subscribe(msg_type, topic, functools.partial(self._audio_common, flavour),
                        AUDIO_QOS)
        logger.info(f'audio_common_msgs ({flavour} flavour) on {topic}')

    def _audio_common(self, flavour, msg, msg_info):
        """Feed audio_common_msgs samples (rate checked as for ~/audio; not numbered)."""
        mode = self._taking()
        if mode is None:
            return
        try:
            samples, rate = messages.audio_common_samples(msg, flavour)
        except ValueError as exc:
            mode.reject_audio(str(exc))
            return
        header = getattr(msg, 'header', None)  # AudioStamped has one, AudioData none
        stamp = header.stamp.sec * 1_000_000_000 + header.stamp.nanosec if header else 0
        mode.audio(samples, rate, -1, received_time(msg_info), stamp or None)


def mode_inputs(node, mode, group):
    """Subscribe the inputs `mode` takes; return them (None: the mode takes none)."""
    if mode.accepts_observations:
        return ObservationInputs(node, mode, group)
    if mode.accepts_audio:
        return AudioInputs(node, mode, group)
    return None
