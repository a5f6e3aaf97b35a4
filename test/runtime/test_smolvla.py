"""SmolVLA from a tiny LeRobot-format checkpoint: loading, the instruction, the arena prefix."""

import json
import os

from flashrt_ros.runtime import ConfigError, InvalidRequestError
from flashrt_ros.runtime.models import ModulePolicyAdapter, PolicySpec
from flashrt_ros.runtime.models.smolvla import attend, INSTRUCTION, INSTRUCTION_LENGTH
from flashrt_ros.runtime.models.smolvla import load_smolvla, PREFIX_KV, PREFIX_MASK
from flashrt_ros.runtime.models.smolvla import save_smolvla_checkpoint, save_tiny_vlm
from flashrt_ros.runtime.models.smolvla import VLM_PATH_ENV
import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
TOP = 'observation.images.top'
STATS = {'observation.state': {'mean': [0.1] * 6, 'std': [2.0] * 6},
         'action': {'mean': [0.5] * 6, 'std': [3.0] * 6}}


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp('smolvla')
    vlm = save_tiny_vlm(root / 'vlm')
    return save_smolvla_checkpoint(root / 'policy', vlm_folder=vlm, seed=1, stats=STATS), vlm


@pytest.fixture
def policy(checkpoint):
    module, spec = load_smolvla(checkpoint[0])
    state = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in module.state_specs(0)}
    module.bind(state)
    return module, spec, state


def _obs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {TOP: torch.rand(3, 48, 64, generator=g),
            'observation.state': torch.randn(6, generator=g)}


def test_a_lerobot_folder_loads_strictly_with_its_spec(policy):
    module, spec, state = policy
    assert spec['horizon'] == 5 and spec['action_dim'] == 6 and spec['obs_dim'] == 6
    assert spec['images'] == ((TOP, (3, 48, 64)),) and spec['replan'] == 'queue_empty'
    assert spec['prefix_tokens'] == 16 + 24 + 1  # one picture's tokens, the language, the state
    assert 'policy_preprocessor_step_5_normalizer_processor' in spec['normalization']
    json.dumps(spec['config'])
    assert state[PREFIX_KV].shape == (4, 2, 2, 41, 16)  # [layers, K|V, kv heads, P, head_dim]
    assert all(not t.any() for t in state.values()), 'zero: no prefix, no instruction'


def test_instruct_tokenizes_as_lerobots_processor_and_refuses_a_long_text(policy):
    module, _, state = policy
    module.instruct('pick up the cube')
    ids = module.tokenizer('pick up the cube\n')['input_ids']  # the newline LeRobot appends
    n = int(state[INSTRUCTION_LENGTH])
    assert state[INSTRUCTION][:n].tolist() == ids and not state[INSTRUCTION][n:].any()
    before = {k: v.clone() for k, v in state.items()}
    with pytest.raises(ValueError, match='it holds 24'):
        module.instruct('x' * 40)
    assert all(torch.equal(before[k], v) for k, v in state.items())


def test_sampling_reads_the_prefix_in_place_and_replays_from_the_same_noise(policy):
    module, _, state = policy
    module.instruct('pick up the cube')
    with torch.inference_mode():
        module.prefix(_obs())
        prefix = {k: v.clone() for k, v in state.items()}
        noise = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
        one = module.sample(None, noise)
        assert all(torch.equal(prefix[k], v) for k, v in state.items()), 'sampling writes nothing'
        assert torch.equal(module.sample(None, noise.clone()), one)
        g = torch.Generator().manual_seed(3)
        assert torch.equal(module.sample(g), one), 'noise comes from the generator'
        assert not torch.equal(module.sample(g), one)
    assert one.shape == (5, 6) and torch.isfinite(one).all()


def test_forward_is_prefix_then_sample(policy, checkpoint):
    module, _, _ = policy
    module.instruct('open the drawer')
    chunk = module(_obs(1), 0, torch.Generator().manual_seed(5))
    other, _ = load_smolvla(checkpoint[0])
    other.bind({s.name: torch.zeros(s.shape, dtype=s.dtype) for s in other.state_specs(0)})
    other.instruct('open the drawer')
    with torch.inference_mode():
        other.prefix(_obs(1))
        assert torch.equal(other.sample(torch.Generator().manual_seed(5)), chunk)


def test_a_shorter_instruction_leaves_no_stale_prefix_rows(policy, checkpoint):
    module, _, state = policy
    with torch.inference_mode():
        module.instruct('pick the red cube')
        module.prefix(_obs())
        module.instruct('stop')
        module.prefix(_obs())
    fresh, _ = load_smolvla(checkpoint[0])
    clean = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in fresh.state_specs(0)}
    fresh.bind(clean)
    fresh.instruct('stop')
    with torch.inference_mode():
        fresh.prefix(_obs())
    assert all(torch.equal(clean[k], state[k]) for k in clean)
    n = int(state[PREFIX_MASK].sum())
    assert n == 16 + len(module.tokenize('stop')) + 1 and not state[PREFIX_MASK][n:].any()
    assert not state[PREFIX_KV][..., n:, :].any()


def test_split_key_blocks_attend_as_one_concatenated_block():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=g)  # [L, H, D], two query heads per key head
    k1, v1, k2, v2 = (torch.randn(2, n, 8, generator=g) for n in (7, 7, 5, 5))
    mask = torch.rand(5, 12, generator=g) > 0.3
    mask[:, 0] = True
    split = attend(q, [k1, k2], [v1, v2], mask, 8)
    whole = attend(q, [torch.cat([k1, k2], 1)], [torch.cat([v1, v2], 1)], mask, 8)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


def test_refusals_name_what_to_fix(policy, checkpoint, tmp_path, monkeypatch):
    module, _, _ = policy
    with pytest.raises(InvalidRequestError, match=TOP):
        module.prefix({'observation.state': torch.zeros(6)})
    with pytest.raises(InvalidRequestError, match=r'\[6\]'):
        module.prefix({**_obs(), 'observation.state': torch.zeros(5)})
    moved = tmp_path / 'moved'
    moved.mkdir()
    for f in checkpoint[0].iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config = json.loads((moved / 'config.json').read_text())
    config['vlm_model_name'] = 'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'
    (moved / 'config.json').write_text(json.dumps(config))
    monkeypatch.delenv(VLM_PATH_ENV, raising=False)
    with pytest.raises(ConfigError, match=VLM_PATH_ENV):
        load_smolvla(moved)
    monkeypatch.setenv(VLM_PATH_ENV, str(checkpoint[1]))
    assert load_smolvla(moved)[1]['prefix_tokens'] == 41
    config['attention_mode'] = 'prefix_lm'
    (moved / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ConfigError, match='attention_mode'):
        load_smolvla(moved)


def test_best_of_n_from_one_prefix_replays_from_a_capsule(checkpoint, make_runtime):
    module, spec = load_smolvla(checkpoint[0])
    adapter = ModulePolicyAdapter(module, PolicySpec(6, 6, 5, images=spec['images'],
                                                     replan='queue_empty'), 8)
    rt = make_runtime('user:smolvla', adapter=adapter)
    rt.instruct('pick up the cube')
    rt.encode(_obs())
    rt.snapshot('prefix')
    candidates = [rt.sample().actions for _ in range(3)]
    rt.restore('prefix')
    assert all(torch.equal(rt.sample().actions, c) for c in candidates)
