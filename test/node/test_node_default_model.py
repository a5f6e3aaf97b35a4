"""The node's default model is the trained checkpoint: by its short name and by its folder."""

from flashrt_ros.node_process import NodeProcess
from flashrt_ros.robot_corpus import system_prompt
from flashrt_ros.runtime.models.hf import DEFAULT_DIR
from node_harness import diagnostics, start_client, wait_active
import pytest

PARAMS = {'max_seq_len': 512,
          'system_prompt': system_prompt({'red cup': 'table', 'blue block': 'shelf'})}
PROMPT = 'put the red cup on the left tray'


@pytest.fixture(scope='module')
def nodes(tmp_path_factory):
    """Two nodes: one without a model parameter (the default), one given the folder path."""
    made = []
    for name, extra in (('flashrt_default', {}), ('flashrt_path', {'model': str(DEFAULT_DIR)})):
        workdir = tmp_path_factory.mktemp(name)
        made.append(NodeProcess(str(workdir), dict(PARAMS, capsule_dir=str(workdir / 'caps'),
                                                   **extra), name=name))
    yield made
    for proc in made:
        proc.stop()


def _reply(proc):
    client = start_client(proc.name)
    try:
        wait_active(client, proc, timeout=240.0)
        # A user turn over the scene (the system message): the start of a plan.
        done = client.generate(PROMPT, max_new_tokens=40, timeout=120.0)
        assert done.result.success, done.result.message
        assert diagnostics(client)['cpu_step'] == 'on'
        return list(done.token_ids), done.result.text
    finally:
        client.close()


def test_default_and_folder_path_serve_the_same_readable_model(nodes):
    by_name, by_path = (_reply(proc) for proc in nodes)
    # Both decode with the compiled CPU step; transformers' exact path gives the same tokens.
    from flashrt_ros.runtime import Runtime, RuntimeConfig
    exact = Runtime(RuntimeConfig(model='default', max_seq_len=512, cpu_step=False))
    try:
        exact.prefill(PARAMS['system_prompt'])
        expected = [e.token_id for e in exact.generate(PROMPT, max_new_tokens=40)]
    finally:
        exact.close()
    assert by_name[0] == expected
    assert 'configured default on cpu' in nodes[0].log(), nodes[0].log()[-2000:]
    assert by_name == by_path
    ids, text = by_name
    assert ids and all(i < 256 for i in ids[:20]), ids
    assert all(c.isprintable() or c in '\n\t' for c in text), repr(text)
    assert len([w for w in text.split() if w.isalpha()]) >= 4, repr(text)
