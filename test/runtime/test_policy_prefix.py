"""A policy with an instruction and a prefix (the shape of a VLA): instruct, encode, sample."""

from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.models import ModulePolicyAdapter, PolicySpec
from flashrt_ros.runtime.state.arena import StateSpec
import pytest
import torch

TOP = 'observation.images.top'


class PrefixPolicy(torch.nn.Module):
    """An instruction, a camera and a state make a prefix once; chunks add fresh noise to it."""

    dict_observations = True

    def __init__(self):
        super().__init__()
        self.encoded = 0  # prefixes computed (not state: what the test counts)

    def state_specs(self, max_steps):
        return [StateSpec('vla.prefix', 'kv', (8,), torch.float32),
                StateSpec('vla.instruction', 'instruction', (16,), torch.int64)]

    def bind(self, views):
        self.kv, self.ids = views['vla.prefix'], views['vla.instruction']

    def instruct(self, text):
        ids = list(text.encode())
        if len(ids) > 16:
            raise ValueError(f'{len(ids)} bytes; it holds 16')
        self.ids.zero_()
        self.ids[:len(ids)] = torch.tensor(ids)

    def prefix(self, observation):
        features = torch.stack([observation[TOP].mean(), observation['observation.state'].mean(),
                                self.ids.float().mean()])  # [3]
        self.kv.copy_(torch.cat([features, features.square(), features[:2]]))  # [8]
        self.encoded += 1

    def sample(self, generator):
        return self.kv[:2].expand(3, 2) + torch.randn(3, 2, generator=generator)  # [3, 2]

    def forward(self, observation, position, generator):
        self.prefix(observation)
        return self.sample(generator)


def _spec():
    return PolicySpec(2, 2, 3, images=((TOP, (3, 4, 4)),), replan='queue_empty')


@pytest.fixture
def vla(make_runtime):
    module = PrefixPolicy()
    rt = make_runtime('user:prefix', adapter=ModulePolicyAdapter(module, _spec(), 64))
    return rt, module


def _obs(level=0.5):
    return {TOP: torch.full((3, 4, 4), level), 'observation.state': [level, -level]}


@pytest.mark.parametrize('tier', ['device', 'host', 'disk'])
def test_best_of_n_from_one_prefix_replays_exactly_from_its_capsule(vla, tier):
    rt, module = vla
    rt.instruct('pick the cup')
    assert rt.encode(_obs()) == 1 and module.encoded == 1
    rt.snapshot('prefix', tier=tier)
    candidates = [rt.sample().actions for _ in range(4)]
    assert module.encoded == 1, 'sampling must not recompute the prefix'
    assert len({tuple(c.flatten().tolist()) for c in candidates}) == 4, 'new noise each draw'
    rt.restore('prefix')
    assert all(torch.equal(rt.sample().actions, c) for c in candidates)
    assert module.encoded == 1


def test_act_is_encode_then_sample(make_runtime):
    one = make_runtime('user:prefix', adapter=ModulePolicyAdapter(PrefixPolicy(), _spec(), 64))
    two = make_runtime('user:prefix', adapter=ModulePolicyAdapter(PrefixPolicy(), _spec(), 64))
    two.encode(_obs())
    assert torch.equal(one.act(_obs()).actions, two.sample().actions)
    assert one.state_digest() == two.state_digest()


def test_an_instruction_is_state_a_boundary_and_drops_the_queue(vla):
    rt, _ = vla
    rt.instruct('pick the cup')
    rt.snapshot('cup')
    cup = rt.act(_obs()).actions
    assert len(rt.pending_actions()) == 3
    rt.instruct('open the door')
    assert len(rt.pending_actions()) == 0
    assert not torch.equal(rt.act(_obs()).actions, cup)
    rt.rollback(2)  # back over that act and the instruction: the end of the cup's act
    assert torch.equal(rt.pending_actions(), cup)
    rt.restore('cup')
    assert torch.equal(rt.act(_obs()).actions, cup)


def test_a_refused_instruction_or_call_leaves_the_state_untouched(vla, make_runtime):
    rt, _ = vla
    rt.instruct('pick the cup')
    digest = rt.state_digest()
    with pytest.raises(InvalidRequestError, match='holds 16'):
        rt.instruct('pick the red cup and put it on the tray')
    with pytest.raises(InvalidRequestError, match='no observation is encoded yet'):
        rt.sample()
    with pytest.raises(InvalidRequestError, match='NUL'):
        rt.instruct('a\0b')
    assert rt.state_digest() == digest
    plain = make_runtime('builtin:tiny-policy')
    with pytest.raises(InvalidRequestError, match='takes no instruction'):
        plain.instruct('pick the cup')
    with pytest.raises(InvalidRequestError, match='keeps no observation prefix'):
        plain.encode([0.0] * 4)
    lm = make_runtime()
    with pytest.raises(InvalidRequestError, match='instruct.. needs a robot policy'):
        lm.instruct('pick the cup')
