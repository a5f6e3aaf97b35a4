"""LeRobot ACT checkpoints: strict loading, normalization, chunks and temporal ensembling."""

import json
import os

from flashrt_ros.runtime.errors import ConfigError, InvalidRequestError
from flashrt_ros.runtime.models.act import ACTPolicy, ENSEMBLE, ENSEMBLE_COUNT, load_act
from flashrt_ros.runtime.models.lerobot import ACTConfig, is_lerobot_checkpoint
from flashrt_ros.runtime.models.lerobot import save_act_checkpoint
import pytest
from safetensors.torch import load_file, save_file
import torch

CAMERA = 'observation.images.top'
ENV = 'observation.environment_state'
# No camera: no ResNet, so these checkpoints are small and quick.
STATE_ONLY = {
    'input_features': {'observation.state': {'type': 'STATE', 'shape': [4]},
                       ENV: {'type': 'ENV', 'shape': [3]}},
    'output_features': {'action': {'type': 'ACTION', 'shape': [2]}},
    'normalization_mapping': {'STATE': 'MEAN_STD', 'ENV': 'MIN_MAX', 'ACTION': 'MEAN_STD'},
}


def _stats(seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {'observation.state': {'mean': r(6), 'std': r(6).abs() + 0.5},
            'action': {'mean': r(6), 'std': r(6).abs() + 0.5, 'count': torch.tensor([7])},
            CAMERA: {'mean': r(3, 1, 1) * 0.1 + 0.5, 'std': r(3, 1, 1).abs() * 0.1 + 0.2}}


def _state_stats():
    return {'observation.state': {'mean': torch.arange(4.0), 'std': torch.full((4,), 2.0)},
            ENV: {'min': -torch.ones(3), 'max': torch.tensor([1.0, 2.0, 3.0])},
            'action': {'mean': torch.tensor([1.0, -1.0]), 'std': torch.tensor([0.5, 3.0])}}


def _observation(seed, state_dim=6, camera=True):
    g = torch.Generator().manual_seed(seed)
    obs = {'observation.state': torch.randn(state_dim, generator=g)}
    if camera:
        obs[CAMERA] = torch.rand(3, 48, 64, generator=g)
    else:
        obs[ENV] = torch.randn(3, generator=g)
    return obs


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """Run these tiny models on one thread: a second one only adds a barrier per op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def camera_ckpt(tmp_path_factory):
    """One ResNet-18 checkpoint with stats for the module (writing one takes a second)."""
    return save_act_checkpoint(tmp_path_factory.mktemp('act') / 'cam', seed=1, stats=_stats(),
                               n_action_steps=4)


def _bound(policy):
    views = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in policy.state_specs(64)}
    policy.bind(views)
    return views


def test_saved_checkpoint_loads_strictly_with_lerobots_names(camera_ckpt):
    weights = load_file(str(camera_ckpt / 'model.safetensors'))
    policy, spec = load_act(camera_ckpt, 'cpu', torch.float32)
    assert set(weights) == set(policy.state_dict())
    for key in ('model.backbone.conv1.weight', 'model.backbone.bn1.running_var',
                'model.backbone.layer2.0.downsample.1.running_mean',
                'model.encoder.layers.0.self_attn.in_proj_weight',
                'model.decoder.layers.0.multihead_attn.out_proj.bias',
                'model.vae_encoder_pos_enc', 'model.encoder_img_feat_input_proj.weight'):
        assert key in weights
    assert not any('num_batches_tracked' in k or k.startswith('model.backbone.fc')
                   for k in weights)
    state = policy.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    assert spec['obs_dim'] == 6 and spec['action_dim'] == 6 and spec['horizon'] == 4
    assert spec['images'] == ((CAMERA, (3, 48, 64)),) and spec['replan'] == 'queue_empty'
    assert 'mean_std' in spec['normalization']
    assert 'policy_preprocessor_step_3_normalizer_processor' in spec['normalization']
    assert spec['config']['type'] == 'act' and json.dumps(spec['config'])
    # torchvision's FrozenBatchNorm2d drops this key when loading; so does ours
    extra = dict(state, **{'model.backbone.bn1.num_batches_tracked': torch.tensor(3)})
    policy.load_state_dict(extra, strict=True)


def test_files_are_written_as_lerobot_writes_them(camera_ckpt):
    config = json.loads((camera_ckpt / 'config.json').read_text())
    assert next(iter(config)) == 'type' and config['type'] == 'act'
    assert config['input_features'][CAMERA] == {'type': 'VISUAL', 'shape': [3, 48, 64]}
    assert config['normalization_mapping']['VISUAL'] == 'MEAN_STD'
    pre = json.loads((camera_ckpt / 'policy_preprocessor.json').read_text())
    post = json.loads((camera_ckpt / 'policy_postprocessor.json').read_text())
    assert [s['registry_name'] for s in pre['steps']] == [
        'rename_observations_processor', 'to_batch_processor', 'device_processor',
        'normalizer_processor']
    assert [s['registry_name'] for s in post['steps']] == ['unnormalizer_processor',
                                                           'device_processor']
    assert pre['steps'][3]['config']['eps'] == 1e-8
    stats = load_file(str(camera_ckpt / pre['steps'][3]['state_file']))
    assert stats['observation.state.mean'].dtype == torch.float32
    assert stats[f'{CAMERA}.std'].shape == (3, 1, 1) and 'action.count' in stats
    assert post['steps'][0]['state_file'] == (
        'policy_postprocessor_step_0_unnormalizer_processor.safetensors')
    assert is_lerobot_checkpoint(camera_ckpt)


def test_normalization_is_lerobots_and_identity_without_stats(camera_ckpt, tmp_path):
    bare = tmp_path / 'bare'
    bare.mkdir()
    for name in ('config.json', 'model.safetensors'):
        os.symlink(camera_ckpt / name, bare / name)
    with_stats, _ = load_act(camera_ckpt, 'cpu', torch.float32)
    identity, spec = load_act(bare, 'cpu', torch.float32)
    assert spec['normalization'] == 'identity (no normalizer files)'
    stats = _stats()
    obs = _observation(5)
    normalized = {key: (x - stats[key]['mean']) / (stats[key]['std'] + 1e-8)
                  for key, x in obs.items()}
    action = stats['action']
    expected = identity.predict_chunk(normalized) * action['std'] + action['mean']
    assert torch.equal(with_stats.predict_chunk(obs), expected)
    assert not torch.equal(identity.predict_chunk(obs), with_stats.predict_chunk(obs))


def test_chunk_is_deterministic_and_queued_actions_are_its_head(camera_ckpt):
    policy, _ = load_act(camera_ckpt, 'cpu', torch.float32)
    assert policy.state_specs(64) == []
    obs = _observation(7)
    chunk = policy.predict_chunk(obs)
    assert chunk.shape == (10, 6) and chunk.dtype == torch.float32
    assert torch.equal(policy.predict_chunk(obs), chunk)
    assert torch.equal(policy(obs, 0, torch.Generator()), chunk[:4])
    # a [T, ...] observation history acts on its last step
    history = {k: torch.stack([_observation(3)[k], v]) for k, v in obs.items()}
    assert torch.equal(policy.predict_chunk(history), chunk)


def _lerobot_ensemble(chunks, coeff):
    """Run ACTTemporalEnsembler.update (LeRobot's code) over a list of [C, A] chunks."""
    size = chunks[0].shape[0]
    weights = torch.exp(-coeff * torch.arange(size))
    cumsum = torch.cumsum(weights, dim=0)
    mean, count, out = None, None, []
    for actions in chunks:
        if mean is None:
            mean, count = actions.clone(), torch.ones((size, 1), dtype=torch.long)
        else:
            mean *= cumsum[count - 1]
            mean += actions[:-1] * weights[count]
            mean /= cumsum[count]
            count = torch.clamp(count + 1, max=size)
            mean = torch.cat([mean, actions[-1:]])
            count = torch.cat([count, torch.ones_like(count[-1:])])
        out.append(mean[0])
        mean, count = mean[1:], count[1:]
    return out


@pytest.mark.parametrize('coeff', [0.01, -0.5])
def test_temporal_ensembling_equals_lerobots(tmp_path, coeff):
    # no stats: the chunks the ensemble averages are the ones predict_chunk returns
    path = save_act_checkpoint(tmp_path / 'ens', seed=2, chunk_size=5, n_action_steps=1,
                               temporal_ensemble_coeff=coeff, **STATE_ONLY)
    policy, spec = load_act(path, 'cpu', torch.float32)
    assert spec['horizon'] == 1
    _bound(policy)
    observations = [_observation(s, 4, camera=False) for s in range(7)]
    chunks = [policy.predict_chunk(o) for o in observations]
    got = [policy(o, t, None) for t, o in enumerate(observations)]
    assert all(a.shape == (1, 2) for a in got)
    want = _lerobot_ensemble(chunks, coeff)
    assert all(torch.equal(a[0], b) for a, b in zip(got, want))
    # and the closed form: at step t the weighted mean of every prediction made for t
    t = 6
    preds = torch.stack([chunks[s][t - s] for s in range(t - 4, t + 1)])  # oldest first
    w = torch.exp(-coeff * torch.arange(5.0))
    torch.testing.assert_close(got[t][0], (w[:, None] * preds).sum(0) / w.sum())


def test_ensemble_state_lives_only_in_the_views(tmp_path):
    path = save_act_checkpoint(tmp_path / 'ens', seed=3, stats=_state_stats(), chunk_size=4,
                               n_action_steps=1, temporal_ensemble_coeff=0.1, **STATE_ONLY)
    policy, _ = load_act(path, 'cpu', torch.float32)
    assert [(s.name, s.shape, s.dtype) for s in policy.state_specs(64)] == [
        (ENSEMBLE, (4, 2), torch.float32), (ENSEMBLE_COUNT, (4,), torch.int64)]
    views = _bound(policy)
    observations = [_observation(s, 4, camera=False) for s in range(6)]
    first = policy(observations[0], 0, None)
    assert torch.equal(first[0], policy.predict_chunk(observations[0])[0])
    for o in observations[1:3]:
        policy(o, 0, None)
    saved = {k: v.clone() for k, v in views.items()}
    later = [policy(o, 0, None) for o in observations[3:]]
    for name, view in views.items():  # restore in place, as a capsule restore does
        view.copy_(saved[name])
    assert all(torch.equal(a, policy(o, 0, None)) for a, o in zip(later, observations[3:]))
    for view in views.values():
        view.zero_()
    assert torch.equal(policy(observations[0], 0, None), first)


@pytest.mark.parametrize('overrides', [
    {'pre_norm': True, 'feedforward_activation': 'gelu', 'n_encoder_layers': 1},
    {'use_vae': False, 'n_decoder_layers': 2},
])
def test_config_variants_load_strictly(tmp_path, overrides):
    path = save_act_checkpoint(tmp_path / 'v', seed=4, **STATE_ONLY, **overrides)
    policy, _ = load_act(path, 'cpu', torch.float32)
    assert set(load_file(str(path / 'model.safetensors'))) == set(policy.state_dict())
    assert any(k.startswith('model.encoder.norm') for k in policy.state_dict()) == (
        overrides.get('pre_norm', False))
    assert policy.predict_chunk(_observation(0, 4, camera=False)).isfinite().all()


@pytest.mark.parametrize('change, field', [
    ({'type': 'diffusion'}, 'type'),
    ({'vision_backbone': 'resnet50'}, 'vision_backbone'),
    ({'chunk_size': 8, 'n_action_steps': 9}, 'n_action_steps'),
    ({'temporal_ensemble_coeff': 0.01, 'n_action_steps': 2}, 'n_action_steps'),
    ({'feedforward_activation': 'glu'}, 'feedforward_activation'),
    ({'normalization_mapping': {'STATE': 'ZSCORE'}}, 'normalization_mapping'),
    ({'replace_final_stride_with_dilation': True}, 'replace_final_stride_with_dilation'),
    ({'n_obs_steps': 2}, 'n_obs_steps'),
    ({'chunk_size': 0}, 'chunk_size'),
    ({'dim_model': 30, 'n_heads': 2}, 'dim_model'),
    ({'use_vae': 'yes'}, 'use_vae'),
    ({'input_features': {'observation.state': {'type': 'STATE', 'shape': [4]}}},
     'input_features'),
    ({'output_features': {'action': {'type': 'ACTION', 'shape': [0]}}}, 'output_features'),
    ({'fancy_new_option': 1}, 'fancy_new_option'),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path, change, field):
    config = ACTConfig.from_json({'type': 'act', **STATE_ONLY}).to_json()
    config.update(change)
    (tmp_path / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_act(tmp_path, 'cpu', torch.float32)
    if field != 'type':
        with pytest.raises(ConfigError, match=f"'{field}'"):
            save_act_checkpoint(tmp_path / 'x', **{**STATE_ONLY, **change})


def test_bad_files_are_refused(tmp_path):
    path = save_act_checkpoint(tmp_path / 'a', seed=5, stats=_state_stats(), **STATE_ONLY)
    weights = load_file(str(path / 'model.safetensors'))
    legacy = dict(weights, **{'normalize_inputs.buffer_observation_state.mean': torch.zeros(4)})
    save_file(legacy, str(path / 'model.safetensors'))
    with pytest.raises(ConfigError, match='LeRobot < 0.4'):
        load_act(path, 'cpu', torch.float32)
    weights.pop('model.action_head.bias')
    save_file(weights, str(path / 'model.safetensors'))
    with pytest.raises(ConfigError, match='action_head.bias'):
        load_act(path, 'cpu', torch.float32)
    pre = json.loads((path / 'policy_preprocessor.json').read_text())
    pre['steps'][0]['config']['rename_map'] = {'observation.joints': 'observation.state'}
    (path / 'policy_preprocessor.json').write_text(json.dumps(pre))
    with pytest.raises(ConfigError, match='rename_map'):
        load_act(path, 'cpu', torch.float32)
    pre['steps'][0]['config']['rename_map'] = {}
    pre['steps'][3]['config']['norm_map']['STATE'] = 'MIN_MAX'
    (path / 'policy_preprocessor.json').write_text(json.dumps(pre))
    with pytest.raises(ConfigError, match='norm_map'):
        load_act(path, 'cpu', torch.float32)


def test_is_lerobot_checkpoint(tmp_path):
    assert not is_lerobot_checkpoint(tmp_path)
    assert not is_lerobot_checkpoint(tmp_path / 'missing')
    (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
    assert not is_lerobot_checkpoint(tmp_path)
    (tmp_path / 'config.json').write_text(json.dumps({'type': 'smolvla'}))
    assert is_lerobot_checkpoint(tmp_path)


def test_observation_errors_name_the_key(tmp_path):
    path = save_act_checkpoint(tmp_path / 'a', seed=6, **STATE_ONLY)
    policy, _ = load_act(path, 'cpu', torch.float32)
    obs = _observation(0, 4, camera=False)
    with pytest.raises(InvalidRequestError, match=ENV):
        policy.predict_chunk({'observation.state': obs['observation.state']})
    with pytest.raises(InvalidRequestError, match='observation.state'):
        policy.predict_chunk({**obs, 'observation.state': torch.zeros(5)})
    assert isinstance(policy, ACTPolicy) and policy.family == 'act'
