"""Policy observations as dicts: cameras, their checks, and images decoded from ROS bytes."""

from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.models import ModulePolicyAdapter, PolicySpec
from flashrt_ros.runtime.modes.policy import image_from_bytes
from flashrt_ros.runtime.state.arena import StateSpec
import pytest
import torch

TOP = 'observation.images.top'
SHAPE = (3, 4, 6)


class CameraPolicy(torch.nn.Module):
    """A camera and a state vector in; a running sum of their means is its state."""

    dict_observations = True

    def state_specs(self, max_steps):
        return [StateSpec('seen', 'recurrent', (2,), torch.float32)]

    def bind(self, views):
        self.seen = views['seen']  # [2]: image mean, state mean, summed over steps

    def forward(self, observation, position, generator):
        image, state = observation[TOP], observation['observation.state']  # [3,H,W], [1,2]
        self.seen.add_(torch.stack([image.mean(), state.mean()]))
        return self.seen.expand(3, 2)


@pytest.fixture
def camera_runtime(make_runtime):
    spec = PolicySpec(2, 2, 3, images=((TOP, SHAPE),), replan='queue_empty')
    return make_runtime('user:camera', adapter=ModulePolicyAdapter(CameraPolicy(), spec, 64))


def _observation(level=0.5, state=(0.25, 0.75)):
    return {TOP: torch.full(SHAPE, level), 'observation.state': list(state)}


def test_a_camera_policy_acts_on_dicts_and_restores_exactly(camera_runtime):
    rt = camera_runtime
    assert rt.act(_observation()).actions[0].tolist() == [0.5, 0.5]
    rt.snapshot('one')
    after = rt.act(_observation(1.0)).actions
    assert after[0].tolist() == [1.5, 1.0]
    rt.restore('one')
    assert torch.equal(rt.act(_observation(1.0)).actions, after)
    uint8 = {TOP: torch.full(SHAPE, 255, dtype=torch.uint8), 'observation.state': [0.0, 0.0]}
    assert rt.act(uint8).actions[0].tolist() == [2.5, 1.0]  # uint8 pixels are taken / 255


@pytest.mark.parametrize('bad, says', [
    ({'observation.state': [0.0, 0.0]}, "missing ['observation.images.top']"),
    (dict(_observation(), **{'observation.images.side': torch.zeros(SHAPE)}),
     "unknown ['observation.images.side']"),
    ({TOP: torch.zeros(3, 5, 6), 'observation.state': [0.0, 0.0]}, 'has shape [3, 5, 6]'),
    ({TOP: torch.full(SHAPE, float('nan')), 'observation.state': [0.0, 0.0]}, 'NaN or Inf'),
    ({TOP: torch.zeros(SHAPE), 'observation.state': [[0.0, 0.0], [0.0, 0.0]]},
     'history of observations'),
    ([0.0, 0.0], "missing ['observation.images.top']"),
])
def test_a_bad_camera_observation_is_refused_and_changes_nothing(camera_runtime, bad, says):
    rt = camera_runtime
    rt.act(_observation())
    digest = rt.state_digest()
    with pytest.raises(InvalidRequestError, match=None) as err:
        rt.act(bad)
    assert says in str(err.value)
    assert rt.state_digest() == digest


def test_a_policy_without_sequence_state_has_no_episode_bound(camera_runtime):
    rt = camera_runtime  # max_seq_len 128, and no state tensor has a sequence axis
    for _ in range(130):
        rt.act(_observation(0.0, (0.0, 0.0)))
    assert rt.position == 130
    rt.snapshot('late')
    rt.reset()
    rt.restore('late')
    assert rt.position == 130


def _pixels(rgb_rows):
    return bytes(v for row in rgb_rows for pixel in row for v in pixel)


def test_images_decode_from_every_encoding_to_the_same_rgb():
    rgb = [[(255, 0, 0), (0, 255, 0)], [(0, 0, 255), (51, 102, 153)]]  # 2x2
    expected = torch.tensor(rgb, dtype=torch.float32).permute(2, 0, 1) / 255.0
    assert torch.equal(image_from_bytes(_pixels(rgb), 2, 2, 'rgb8', 6, (3, 2, 2)), expected)
    bgr = [[p[::-1] for p in row] for row in rgb]
    assert torch.equal(image_from_bytes(_pixels(bgr), 2, 2, 'bgr8', 6, (3, 2, 2)), expected)
    rgba = [[p + (7,) for p in row] for row in rgb]
    assert torch.equal(image_from_bytes(_pixels(rgba), 2, 2, 'rgba8', 8, (3, 2, 2)), expected)
    padded = b''.join(_pixels([row]) + b'\0\0' for row in rgb)  # step 8: 2 bytes of padding
    assert torch.equal(image_from_bytes(padded, 2, 2, 'rgb8', 8, (3, 2, 2)), expected)
    mono = image_from_bytes(bytes([0, 51, 102, 255]), 2, 2, 'mono8', 2, (3, 2, 2))
    assert torch.equal(mono[0], mono[2]) and mono[0, 1, 1] == 1.0


def test_an_image_of_another_size_is_resized_to_the_policys():
    image = image_from_bytes(bytes([128] * 3 * 8 * 12), 8, 12, 'rgb8', 36, (3, 4, 6))
    assert image.shape == (3, 4, 6)
    assert torch.allclose(image, torch.full((3, 4, 6), 128 / 255.0))


@pytest.mark.parametrize('args, says', [
    ((bytes(12), 2, 2, 'yuv422', 6), "encoding 'yuv422' is not taken"),
    ((bytes(11), 2, 2, 'rgb8', 6), 'it holds 11'),
    ((bytes(8), 2, 2, 'rgb8', 4), 'step >= 6'),
    ((b'', 0, 0, 'rgb8', 0), 'must hold'),
])
def test_a_malformed_image_is_refused_saying_why(args, says):
    with pytest.raises(InvalidRequestError) as err:
        image_from_bytes(*args, (3, 2, 2))
    assert says in str(err.value)
