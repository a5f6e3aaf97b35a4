"""Fixtures of the session tests: active Sessions over real runtimes (tiny model, CPU)."""

from flashrt_ros.runtime import Runtime, RuntimeConfig
from flashrt_ros.session import Session
import pytest
from session_harness import HOME, Recorder, SETTINGS, SYSTEM_PROMPT


@pytest.fixture
def settings():
    return dict(SETTINGS)


@pytest.fixture
def make_session(tmp_path, settings):
    """Build active Sessions over fresh runtimes; all closed at teardown."""
    made = []

    def make(model='builtin:tiny-hybrid', mode='lm', **config):
        values = {'model': model, 'device': 'cpu', 'max_seq_len': 512, 'rollback_depth': 4,
                  'capsule_dir': str(tmp_path / 'capsules')}
        values.update(config)
        out = Recorder()
        session = Session(Runtime(RuntimeConfig(**values)), mode, settings.get, out)
        made.append(session)
        session.turns.start()
        session.warm_up(HOME, SYSTEM_PROMPT)
        session.turns.set_active(True)
        return session, out

    yield make
    for session in made:
        for gate in session._out.gates.values():
            gate.opened.set()
        session.close()
