"""A LeRobot ACT checkpoint served by the Runtime: capsules carry its queue and ensembling."""

from flashrt_ros.runtime.models.lerobot import save_act_checkpoint
import pytest
import torch

TOP = 'observation.images.top'


def _observations(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{'observation.state': torch.randn(6, generator=g),
             TOP: torch.rand(3, 48, 64, generator=g)} for _ in range(n)]


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp('act')
    return {'queue': save_act_checkpoint(root / 'queue', seed=1, n_action_steps=4),
            'ensemble': save_act_checkpoint(root / 'ensemble', seed=2, n_action_steps=1,
                                            temporal_ensemble_coeff=0.01)}


@pytest.mark.parametrize('tier', ['device', 'host', 'disk'])
def test_a_restore_replays_the_ensembled_actions_bit_for_bit(make_runtime, folders, tier):
    rt = make_runtime(str(folders['ensemble']), max_seq_len=8)
    assert rt.policy_spec.horizon == 1 and 'ensemble' in ' '.join(rt.arena.views)
    before, after = _observations(4, seed=1), _observations(12, seed=2)
    for obs in before:
        rt.act(obs)
    rt.snapshot('mid', tier=tier)
    digest = rt.state_digest()
    first = [rt.act(obs).actions for obs in after]  # past max_seq_len: no sequence state
    rt.restore('mid')
    assert rt.state_digest() == digest
    assert all(torch.equal(a, b) for a, b in zip(first, [rt.act(obs).actions for obs in after]))
    rt.reset()
    fresh = rt.act(after[0]).actions  # a zeroed ensemble: the chunk's own first action
    assert not torch.equal(fresh, first[0])


def test_the_action_queue_comes_back_with_a_restore(make_runtime, folders):
    rt = make_runtime(str(folders['queue']))
    chunk = rt.act(_observations(1)[0]).actions  # [4, 6]: n_action_steps queued
    assert chunk.shape == (4, 6) and rt.policy_spec.replan == 'queue_empty'
    assert torch.equal(rt.next_action(), chunk[0])
    rt.snapshot('one_taken', tier='host')
    taken = [rt.next_action() for _ in range(3)]
    assert rt.next_action() is None
    rt.restore('one_taken')
    assert torch.equal(rt.pending_actions(), chunk[1:])
    assert all(torch.equal(rt.next_action(), a) for a in taken)


def test_the_builtin_act_arm_is_a_lerobot_checkpoint_with_normalizers(make_runtime):
    rt = make_runtime('builtin:act-arm')
    spec = rt.policy_spec
    assert spec.images == ((TOP, (3, 96, 128)),) and (spec.obs_dim, spec.action_dim) == (2, 2)
    assert 'policy_preprocessor_step_3_normalizer_processor.safetensors' in spec.note
    again = make_runtime('builtin:act-arm')  # the same cached folder, the same weights
    assert again.fingerprint == rt.fingerprint
    obs = {'observation.state': [0.1, -0.2], TOP: torch.full((3, 96, 128), 0.5)}
    assert torch.equal(rt.act(obs).actions, again.act(obs).actions)
