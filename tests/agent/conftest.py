import pytest
from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.traces import TraceStore


@pytest.fixture
def store(tmp_path):
    s = TraceStore(tmp_path / "home" / "traces.db")
    yield s
    s.close()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "README.md").write_text("# calc\n")
    return root


def scripted(*turns, cps=0.0, **kw):
    return ScriptedModel(list(turns), chars_per_second=cps, **kw)
