"""A task module given as a file imports the modules beside it, as `python task.py` would
(tracetrain/agents/tasks.py load_task)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_task_file_imports_a_module_beside_it_from_any_working_directory(tmp_path):
    folder, elsewhere = tmp_path / "my_task", tmp_path / "elsewhere"
    folder.mkdir(), elsewhere.mkdir()
    (folder / "tt_helper_beside_task.py").write_text("WORDS = ['left', 'right']\n")
    (folder / "task.py").write_text(textwrap.dedent("""
        from tt_helper_beside_task import WORDS

        def tasks(n, seed=0):
            return [{"word": w} for w in WORDS[:n]]
    """))
    # a fresh interpreter: neither the folder nor the test's own paths are on sys.path
    code = ("from tracetrain.agents.tasks import load_task; "
            f"print(load_task({str(folder / 'task.py')!r}).tasks(2))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[{'word': 'left'}, {'word': 'right'}]"
