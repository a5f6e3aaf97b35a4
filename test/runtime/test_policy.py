"""Policy mode: observations in, action chunks out, with the same capsule guarantees."""

import json
import math
import threading

from flashrt_ros.runtime import ConfigError, FlashRTError, InvalidRequestError, PreemptedError
from flashrt_ros.runtime.models import ModulePolicyAdapter, PolicySpec, save_policy
from flashrt_ros.runtime.state.arena import StateSpec
import pytest
import torch

POLICY = 'builtin:tiny-policy'


def _observations(n, seed):
    """Return n deterministic, distinct 4-d observations (joint positions and velocities)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g).tolist()


def _run(rt, observations, take=2):
    """Act on each observation and take `take` queued actions; return everything produced."""
    out = []
    for obs in observations:
        out.append(rt.act(obs).actions)
        out.extend(rt.next_action() for _ in range(take))
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def policy(make_runtime):
    return make_runtime(POLICY)


def test_restore_replays_byte_exact_and_action_identical(policy):
    rt = policy
    _run(rt, _observations(5, seed=0))
    rt.next_action()  # a part-executed chunk: the queue is part of the state
    info = rt.snapshot('decision')
    digest, queue = rt.state_digest(), rt.pending_actions()
    assert info.position == rt.position == 5 and len(queue) == 8 - 3
    assert set(info.components) >= {'kv', 'conv', 'recurrent', 'actions', 'rng'}
    branch_a = _run(rt, _observations(6, seed=1))
    rt.restore('decision')
    branch_b = _run(rt, _observations(6, seed=2))
    assert not _same(branch_a, branch_b)
    rt.restore('decision')
    assert rt.state_digest() == digest and rt.position == 5
    assert torch.equal(rt.pending_actions(), queue)
    assert _same(_run(rt, _observations(6, seed=1)), branch_a)


def test_rng_is_part_of_the_state(policy):
    rt = policy  # tiny-policy adds noise drawn from the runtime RNG to every chunk
    rt.act([0.0] * 4)
    rt.snapshot('s')
    first = rt.act([0.5] * 4).actions
    rt.restore('s')
    rt.generator.manual_seed(99)  # bytes restored, RNG moved: the same step must differ
    assert not torch.equal(rt.act([0.5] * 4).actions, first)
    rt.restore('s')
    assert torch.equal(rt.act([0.5] * 4).actions, first)


def test_kv_only_restore_diverges_for_the_hybrid_policy(policy):
    rt = policy
    _run(rt, _observations(6, seed=3))
    rt.snapshot('a')
    reference = _run(rt, _observations(4, seed=4))
    _run(rt, _observations(6, seed=5))  # conv/recurrent state now hold another history
    rt.restore('a', mode='kv_only')
    assert rt.position == 6
    assert not _same(_run(rt, _observations(4, seed=4)), reference), \
        'recurrent/conv state is load-bearing: KV alone must not suffice'
    rt.restore('a')
    assert _same(_run(rt, _observations(4, seed=4)), reference)


def test_every_control_step_is_a_committed_boundary(policy):
    rt = policy
    digests = []
    for obs in _observations(3, seed=6):
        rt.act(obs)
        digests.append(rt.state_digest())
    info = rt.rollback(1)
    assert info.position == rt.position == 2 and rt.state_digest() == digests[1]
    stats = rt.stats()
    assert stats.control_step_s > 0 and stats.to_dict()['control_step_s'] == stats.control_step_s


@pytest.mark.parametrize('bad', [
    [0.1, 0.2, 0.3],                              # too short
    [0.1, 0.2, 0.3, 0.4, 0.5],                    # too long
    [0.1, float('nan'), 0.3, 0.4],
    [0.1, 0.2, float('inf'), 0.4],
    [0.1, 0.2, 0.3, 1e39],                        # overflows float32 to inf
    [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2]],           # ragged
    [[[0.1, 0.2, 0.3, 0.4]]],                     # 3-d
    [],
    'abcd',
    None,
])
def test_bad_observations_are_rejected_and_leave_the_state_alone(policy, bad):
    rt = policy
    rt.act([0.1, 0.2, 0.3, 0.4])
    digest, position = rt.state_digest(), rt.position
    with pytest.raises(InvalidRequestError):
        rt.act(bad)
    assert rt.state_digest() == digest and rt.position == position
    assert rt.rollback(1).position == 0  # the ring holds no boundary from the bad step


def test_interrupt_drops_the_pending_queue(policy):
    rt = policy
    rt.act([0.1, 0.2, 0.3, 0.4])
    assert rt.next_action() is not None and len(rt.pending_actions()) == 7
    rt.interrupt()
    assert len(rt.pending_actions()) == 0 and rt.next_action() is None
    assert rt.position == 1  # the folded observation stays; only the stale actions go


def act_in_thread(rt, observation):
    """Start act(observation) on a thread; return it and the list its outcome goes to."""
    outcome = []

    def run():
        try:
            outcome.append(rt.act(observation))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize('how', ['restore', 'rollback'])
def test_a_preempting_restore_or_rollback_abandons_a_running_act(policy, hold_in_forward, how):
    rt = policy
    obs = _observations(3, seed=5)
    rt.act(obs[0])
    if how == 'restore':
        rt.next_action()  # the queue as it stands goes into the capsule
        rt.snapshot('before')
    else:  # lands on the newest boundary: the abandoned act is none
        rt.snapshot('before')
        rt.act(obs[1])
    digest, queue, position = rt.state_digest(), rt.pending_actions(), rt.position
    if how == 'restore':
        rt.act(obs[1])
    inside = hold_in_forward(rt.adapter.module.backbone.layers[0])  # its state written
    thread, outcome = act_in_thread(rt, obs[2])
    assert inside.wait(10.0)
    info = (rt.restore('before', preempt=True) if how == 'restore'
            else rt.rollback(1, preempt=True))
    thread.join(10.0)
    assert not thread.is_alive() and isinstance(outcome[0], PreemptedError)
    assert 'abandoned' in str(outcome[0]) and 'no actions' in str(outcome[0])
    assert info.position == rt.position == position
    assert rt.state_digest() == digest
    assert torch.equal(rt.pending_actions(), queue)
    fresh = _run(rt, obs[2:])  # the torn step left nothing behind: it replays exactly
    rt.restore('before')
    if how == 'rollback':
        rt.act(obs[1])
    assert _same(_run(rt, obs[2:]), fresh)


def test_should_stop_refuses_an_act_before_it_touches_the_state(policy):
    rt = policy
    rt.act([0.1, 0.2, 0.3, 0.4])
    digest, queue = rt.state_digest(), rt.pending_actions()
    with pytest.raises(PreemptedError, match='did not start'):
        rt.act([0.5, 0.6, 0.7, 0.8], should_stop=lambda: True)
    assert rt.state_digest() == digest and torch.equal(rt.pending_actions(), queue)
    assert rt.act([0.5, 0.6, 0.7, 0.8], should_stop=lambda: False).step == 2


def test_reset_and_full_episode(make_runtime):
    rt = make_runtime(POLICY, max_seq_len=8)
    empty = rt.state_digest()
    rt.act(torch.zeros(8, 4))  # a history of 8 observations in one batched step
    assert rt.position == 8
    with pytest.raises(InvalidRequestError, match='episode is full'):
        rt.act([0.0] * 4)
    rt.reset()
    assert rt.position == 0 and rt.state_digest() == empty and rt.next_action() is None


def test_modes_refuse_each_others_calls(policy, make_runtime):
    with pytest.raises(InvalidRequestError, match='robot policy'):
        policy.generate('hello')
    with pytest.raises(InvalidRequestError, match='robot policy'):
        policy.prefill('hello')
    lm = make_runtime('builtin:tiny-mamba2')
    with pytest.raises(InvalidRequestError, match='language model'):
        lm.act([0.0] * 4)


def test_local_checkpoint_loads_the_same_policy(policy, make_runtime, tmp_path):
    path = save_policy(POLICY, tmp_path / 'ckpt')
    assert (path / 'policy.json').is_file() and (path / 'model.safetensors').is_file()
    local = make_runtime(str(path))
    assert local.fingerprint == policy.fingerprint
    assert local.policy_spec == policy.policy_spec
    assert local.policy_spec.joint_names == ('shoulder', 'elbow')
    observations = _observations(4, seed=7)
    assert _same(_run(local, observations), _run(policy, observations))
    policy.snapshot('shared', tier='disk')  # the two runtimes share one capsule dir
    local.restore('shared')
    assert local.state_digest() == policy.state_digest()


def test_bad_policy_checkpoint_is_a_config_error(make_runtime, tmp_path):
    (tmp_path / 'policy.json').write_text('{"obs_dim": 4, "action_dim": 0, "horizon": 8}')
    with pytest.raises(ConfigError, match='action_dim'):
        make_runtime(str(tmp_path))


class GRUPolicy(torch.nn.Module):
    """A user's own policy: one GRU cell whose hidden state lives in the arena."""

    def __init__(self, obs_dim=3, hidden=16, horizon=4, action_dim=2):
        super().__init__()
        self.cell = torch.nn.GRUCell(obs_dim, hidden)
        self.head = torch.nn.Linear(hidden, horizon * action_dim)
        self.shape, self.hidden_size = (horizon, action_dim), hidden

    def state_specs(self, max_steps):
        return [StateSpec('gru.h', 'recurrent', (1, self.hidden_size), torch.float32)]

    def bind(self, views):
        self.h = views['gru.h']  # [1, hidden]: read and written in place only

    def forward(self, observations, position, generator):
        for obs in observations:
            self.h.copy_(self.cell(obs.unsqueeze(0), self.h))
        return torch.tanh(self.head(self.h[0])).view(self.shape)


def test_a_user_module_gets_the_same_capsule_guarantees(make_runtime):
    torch.manual_seed(0)
    module = GRUPolicy()
    adapter = ModulePolicyAdapter(module, PolicySpec(3, 2, 4), max_steps=128)
    rt = make_runtime('user:gru-policy', adapter=adapter)
    empty = rt.state_digest()
    assert rt.components == ['recurrent', 'actions', 'rng', 'meta']
    rt.act([0.1, 0.2, 0.3])
    rt.snapshot('s')
    first = _run(rt, [[0.3, 0.2, 0.1], [1.0, 0.0, -1.0]], take=1)
    rt.restore('s')
    assert _same(_run(rt, [[0.3, 0.2, 0.1], [1.0, 0.0, -1.0]], take=1), first)
    rt.restore('s', mode='kv_only')  # leaves the recurrent state of the newer steps
    assert not torch.equal(rt.act([0.3, 0.2, 0.1]).actions, first[0])
    rt.reset()
    assert rt.state_digest() == empty
    assert math.isclose(float(module.h.abs().sum()), 0.0)


def test_a_user_module_on_another_device_is_a_config_error(make_runtime):
    module = GRUPolicy()
    module.head.to('meta')  # any device but the runtime's: the CUDA recipe left on the CPU
    adapter = ModulePolicyAdapter(module, PolicySpec(3, 2, 4), max_steps=128)
    with pytest.raises(ConfigError, match=r'on meta but the runtime runs on cpu.*module\.to'):
        make_runtime('user:gru-policy', adapter=adapter)


class Integrator(torch.nn.Module):
    """A policy without parameters: it sums its observations into its state."""

    def state_specs(self, max_steps):
        return [StateSpec('sum', 'recurrent', (3,), torch.float32)]

    def bind(self, views):
        self.sum = views['sum']

    def forward(self, observations, position, generator):
        self.sum.add_(observations.sum(0))
        return self.sum[:2].expand(4, 2)


def test_a_module_without_parameters_runs_on_the_runtimes_device(make_runtime):
    adapter = ModulePolicyAdapter(Integrator(), PolicySpec(3, 2, 4), max_steps=16)
    assert adapter.device is None  # not a CPU module: it has nothing on any device
    rt = make_runtime('user:integrator', adapter=adapter)
    assert adapter.device == rt.device
    assert rt.act([1.0, 2.0, 3.0]).actions[0].tolist() == [1.0, 2.0]


class Counter(GRUPolicy):
    """Keeps the meta dict it is given and counts its steps in it."""

    def __init__(self):
        super().__init__()
        self.meta = {'count': {'steps': 0}}  # nested: a shallow copy shares it

    def export_meta(self):
        return self.meta

    def import_meta(self, meta):
        self.meta = meta

    def reset_meta(self):
        self.meta = {'count': {'steps': 0}}

    def forward(self, observations, position, generator):
        self.meta['count']['steps'] += len(observations)
        return super().forward(observations, position, generator)


def test_a_module_that_keeps_its_meta_cannot_change_a_capsule(make_runtime):
    torch.manual_seed(0)
    adapter = ModulePolicyAdapter(Counter(), PolicySpec(3, 2, 4), max_steps=128)
    rt = make_runtime('user:counter', adapter=adapter)
    rt.act([0.1, 0.2, 0.3])
    rt.snapshot('a', 'host')
    rt.act([0.0, 0.0, 0.0])  # updates the dict the module exported to the snapshot
    rt.restore('a')
    assert adapter.module.meta['count']['steps'] == 1
    for _ in range(5):
        rt.act([0.0, 0.0, 0.0])  # updates the dict the restore handed over
    rt.fork('a', 'a-disk', tier='disk')
    assert json.loads(rt.store.get('a-disk').meta_json)['adapter']['count']['steps'] == 1
    rt.restore('a')
    assert adapter.module.meta['count']['steps'] == 1


def test_only_the_cache_bindings_own_meta_hooks_get_a_capsules_meta_itself(make_runtime):
    spec = PolicySpec(3, 2, 4)
    assert ModulePolicyAdapter(GRUPolicy(), spec, max_steps=128).meta_trusted  # no hooks
    assert not ModulePolicyAdapter(Counter(), spec, max_steps=128).meta_trusted
    adapter = make_runtime(POLICY).adapter
    assert adapter.meta_trusted  # the built-in backbone policy: its binding only reads
    cls = type(adapter.module)
    adapter.module.__class__ = type('Extended', (cls,), {
        'import_meta': lambda self, meta: cls.import_meta(self, meta)})
    assert not adapter.meta_trusted  # a subclass's own import_meta may keep what it gets


class GradPlanner(torch.nn.Module):
    """Refines its action chunk with a few gradient steps inside forward (test-time search)."""

    def __init__(self):
        super().__init__()
        self.cost = torch.nn.Linear(3 + 8, 1)

    def state_specs(self, max_steps):
        return [StateSpec('h', 'recurrent', (3,), torch.float32)]

    def bind(self, views):
        self.h = views['h']

    def forward(self, observations, position, generator):
        self.h.copy_(observations[-1])
        a = torch.zeros(8)
        with torch.enable_grad():
            for _ in range(3):
                a.requires_grad_(True)
                loss = self.cost(torch.cat([self.h, a])).sum() + (a ** 2).sum()
                (g,) = torch.autograd.grad(loss, a)
                a = (a - 0.1 * g).detach()
        return a.view(4, 2)


def test_a_user_module_may_use_autograd_and_gets_plain_tensors(make_runtime):
    adapter = ModulePolicyAdapter(GradPlanner(), PolicySpec(3, 2, 4), max_steps=16)
    rt = make_runtime('user:grad-planner', adapter=adapter)
    actions = rt.act([0.1, 0.2, 0.3]).actions
    assert actions.shape == (4, 2) and not torch.is_inference(actions)
    actions.clamp_(-1.0, 1.0)  # the caller's copy: editable in place


class Flaky(GRUPolicy):
    """Steps its state, then fails on request (a wrong action shape, after the write)."""

    fail = False

    def forward(self, observations, position, generator):
        actions = super().forward(observations, position, generator)
        return actions[:1] if self.fail else actions


def test_a_policy_step_that_fails_after_writing_state_leaves_it_intact(make_runtime):
    torch.manual_seed(0)
    module = Flaky()
    adapter = ModulePolicyAdapter(module, PolicySpec(3, 2, 4), max_steps=128)
    rt = make_runtime('user:flaky', adapter=adapter)
    rt.act([0.1, 0.2, 0.3])
    rt.next_action()  # executed actions are not a commit: they must not come back
    before, position = rt.state_digest(), rt.position
    module.fail = True
    with pytest.raises(Exception, match='policy module returned actions of shape'):
        rt.act([0.5, 0.5, 0.5])
    assert rt.state_digest() == before and rt.position == position
    assert len(rt.pending_actions()) == 3
    module.fail = False
    rt.act([0.3, 0.2, 0.1])  # and it keeps serving


def test_nan_actions_are_never_queued_and_the_state_is_put_back(make_runtime):
    # Inputs near float32's limit overflow inside the encoder: the chunk comes out NaN.
    rt = make_runtime(POLICY)
    rt.act([0.1, 0.2, 0.3, 0.4])
    before, queue = rt.state_digest(), rt.pending_actions()
    with pytest.raises(FlashRTError, match='NaN or Inf actions'):
        rt.act([3e38, 3e38, 3e38, 3e38])
    assert rt.state_digest() == before and torch.equal(rt.pending_actions(), queue)
    assert torch.isfinite(rt.act([0.1, 0.2, 0.0, 0.0]).actions).all()  # and it keeps serving


def test_an_observation_the_model_dtype_cannot_hold_is_refused(make_runtime):
    rt = make_runtime(POLICY, dtype='float16')
    rt.act([0.1, 0.2, 0.3, 0.4])
    before = rt.state_digest()
    with pytest.raises(InvalidRequestError, match='overflows the model dtype'):
        rt.act([7e4, 0.0, 0.0, 0.0])  # float16 tops out at 65504
    assert rt.state_digest() == before
    assert rt.act([0.5, 0.0, 0.0, 0.0]).step == 2  # a value it can hold goes in


def test_measure_policy_returns_the_figures(tmp_path):
    from flashrt_ros.bench.measure_policy import measure_policy

    r = measure_policy(lengths=(4, 8), repeats=2, stepwise_max=4, capsule_dir=str(tmp_path))
    short, long = r['lengths']
    assert short['length'] == 4 and short['same_actions'] and short['stepwise_speedup'] > 0
    assert long['cold_stepwise_next_chunk_s'] is None and long['restore']['n'] == 2
    assert long['control_step']['median_s'] > 0 and long['batched_speedup'] > 0
