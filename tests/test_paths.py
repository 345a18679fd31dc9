"""paths.near_config: an absolute path as given; a relative one beside the config file, then in
the working directory; the same lookup and message for every key that names a file."""

from __future__ import annotations

import pytest

from tracetrain.config import ConfigError
from tracetrain.paths import candidates, near_config, not_found


@pytest.fixture
def two_places(tmp_path, monkeypatch):
    base, cwd = tmp_path / "configs", tmp_path / "cwd"
    base.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return base, cwd


def test_beside_the_config_wins_then_the_working_directory(two_places):
    base, cwd = two_places
    (cwd / "t.py").write_text("")
    assert near_config("t.py", base, lambda p: p.is_file()) == cwd / "t.py"
    (base / "t.py").write_text("")
    assert near_config("t.py", base, lambda p: p.is_file()) == base / "t.py"
    assert near_config("t.py", None) == cwd / "t.py"  # no config file: the working directory
    assert near_config(str(cwd / "t.py"), base) == cwd / "t.py"
    assert near_config("missing.py", base) is None
    assert candidates("missing.py", base) == [base / "missing.py", cwd / "missing.py"]
    (base / "d").mkdir()
    assert near_config("d", base, lambda p: p.is_file()) is None  # a folder is not a file


def test_each_key_that_names_a_file_finds_it_and_says_where_it_looked(two_places):
    from tracetrain.agents.tasks import load_task, open_task_data
    from tracetrain.config.load import build_config
    from tracetrain.registry import import_plugins

    base, cwd = two_places
    (cwd / "task.py").write_text("def tasks(n, seed=0):\n    return []\n")
    (base / "plug.py").write_text("X = 1\n")
    assert load_task("task.py", base).tasks(1) == []
    assert import_plugins(["plug.py"], base) == [str((base / "plug.py").resolve())]
    msg = not_found("nope.py", base)
    with pytest.raises(ConfigError, match="'task'.*" + msg.split("(")[0]):
        load_task("nope.py", base)
    with pytest.raises(ValueError) as e:
        import_plugins(["nope.py"], base)
    assert msg in str(e.value)
    cfg = build_config({"task": "task.py", "data": {"train": "rows.jsonl"}}, [], base_dir=base)
    with pytest.raises(ConfigError) as e:
        open_task_data(cfg, base)
    assert "'data.train'" in str(e.value) and not_found("rows.jsonl", base) in str(e.value)
    (cwd / "rows.jsonl").write_text('{"q": 1}\n')
    assert len(open_task_data(cfg, base).train_rows) == 1
