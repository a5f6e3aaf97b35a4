"""A LeRobot SmolVLA folder served by the Runtime: its instruction and prefix in capsules."""

from flashrt_ros.runtime.models.smolvla import save_smolvla_checkpoint, save_tiny_vlm
import pytest
import torch

TOP = 'observation.images.top'


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp('smolvla')
    return save_smolvla_checkpoint(root / 'policy', vlm_folder=save_tiny_vlm(root / 'vlm'),
                                   seed=2)


def _obs(seed):
    g = torch.Generator().manual_seed(seed)
    return {'observation.state': torch.randn(6, generator=g),
            TOP: torch.rand(3, 48, 64, generator=g)}


@pytest.mark.parametrize('tier', ['device', 'host', 'disk'])
def test_restore_replays_the_next_chunks_and_draws_bit_for_bit(make_runtime, folder, tier):
    rt = make_runtime(str(folder))
    assert rt.policy_spec.replan == 'queue_empty' and rt.adapter.has_prefix
    rt.instruct('pick up the cube')
    rt.act(_obs(1))
    rt.snapshot('grasp', tier=tier)
    digest = rt.state_digest()
    later = [rt.act(_obs(2)).actions, rt.sample().actions]
    rt.instruct('put it down')
    other = rt.act(_obs(2)).actions
    rt.restore('grasp')  # the policy at the decision point: its instruction, prefix, queue, RNG
    assert rt.state_digest() == digest and len(rt.pending_actions()) == rt.policy_spec.horizon
    again = [rt.act(_obs(2)).actions, rt.sample().actions]
    assert all(torch.equal(a, b) for a, b in zip(again, later))
    assert not torch.equal(other, later[0]), 'the instruction must change the chunk'
