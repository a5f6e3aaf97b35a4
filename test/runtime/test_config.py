"""RuntimeConfig validation: unknown keys and bad values are refused with a clear message."""

from flashrt_ros.runtime import ConfigError, RuntimeConfig
import pytest


def test_defaults_match_the_contract():
    cfg = RuntimeConfig()
    assert cfg.model == 'default'
    assert (cfg.device, cfg.dtype, cfg.eviction) == ('cpu', 'auto', 'refuse')
    assert cfg.max_seq_len == 4096 and cfg.rollback_depth == 8
    assert cfg.prompt_format == 'auto' and cfg.device_budget_bytes == -1


def test_auto_budgets_are_sized_from_the_arena():
    cfg = RuntimeConfig(host_budget_bytes=0, disk_budget_bytes=123)
    small = cfg.sized_budgets(1 << 20)  # a small arena: the fixed floors
    assert small == {'device': 256 << 20, 'host': 0, 'disk': 123, 'ring': 256 << 20}
    big = cfg.sized_budgets(1 << 30)  # a 1 GiB arena: 4 (device) and 2 (ring) full states
    assert (big['device'], big['ring'], big['host']) == (4 << 30, 2 << 30, 0)


def test_from_dict_and_yaml(tmp_path):
    cfg = RuntimeConfig.from_dict(
        {'model': 'builtin:tiny-lfm2', 'max_seq_len': 64, 'eviction': 'lru'}
    )
    assert (cfg.model, cfg.max_seq_len, cfg.eviction) == ('builtin:tiny-lfm2', 64, 'lru')
    path = tmp_path / 'rt.yaml'
    path.write_text('model: builtin:tiny-mamba2\ndtype: bfloat16\ncuda_graphs: false\n')
    cfg = RuntimeConfig.from_yaml(path)
    assert (cfg.model, cfg.dtype, cfg.cuda_graphs) == ('builtin:tiny-mamba2', 'bfloat16', False)


@pytest.mark.parametrize(
    'values, words',
    [
        ({'modle': 'x'}, 'unknown config keys'),
        ({'device': 'gpu'}, 'device'),
        ({'dtype': 'float8'}, 'dtype'),
        ({'max_seq_len': 0}, 'max_seq_len'),
        ({'max_seq_len': 1.5}, 'max_seq_len'),
        ({'device_budget_bytes': -2}, 'device_budget_bytes'),
        ({'ring_budget_bytes': -2}, 'ring_budget_bytes'),
        ({'prompt_format': 'jinja'}, 'prompt_format'),
        ({'host_budget_bytes': True}, 'host_budget_bytes'),
        ({'eviction': 'fifo'}, 'eviction'),
        ({'cuda_graphs': 'yes'}, 'cuda_graphs'),
        ({'rollback_depth': -2}, 'rollback_depth'),
        ({'model': ''}, 'model'),
    ],
)
def test_bad_values_are_refused(values, words):
    with pytest.raises(ConfigError, match=words):
        RuntimeConfig.from_dict(values)


def test_bad_yaml_is_a_config_error(tmp_path):
    path = tmp_path / 'bad.yaml'
    path.write_text('model: [unclosed\n')
    with pytest.raises(ConfigError, match='not valid YAML'):
        RuntimeConfig.from_yaml(path)
    with pytest.raises(ConfigError, match='cannot read'):
        RuntimeConfig.from_yaml(tmp_path / 'missing.yaml')


def test_unknown_model_ids_fail_clearly(make_runtime, tmp_path):
    with pytest.raises(ConfigError, match='builtin:tiny-hybrid'):
        make_runtime('builtin:no-such-model')
    with pytest.raises(ConfigError, match='checkpoint directory'):
        make_runtime(str(tmp_path / 'nowhere'))


def test_too_old_transformers_is_a_clear_error():
    from flashrt_ros.runtime.models.binding import check_transformers_version

    with pytest.raises(ConfigError, match=r'transformers 5\.17\.0 is too old.*>=5\.24,<6'):
        check_transformers_version('5.17.0')
    for version in ('5.24.0', '5.24.1', '5.30.0.dev0', '6.0.0'):
        check_transformers_version(version)
