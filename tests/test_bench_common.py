"""The benchmark harness: a run stopped by SIGTERM (`timeout`) still prints its table and writes its JSON."""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigterm_prints_the_table_and_writes_partial_json(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        import benchmarks.common as c
        c.Bench._env = staticmethod(lambda: {{"env": "test"}})
        b = c.Bench("stopped")
        b.rows.append(dict(group="g", name="first row", ms=1.5))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("not reached")
    """)
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 124, done.stderr[-2000:]
    assert "first row" in done.stdout and "not reached" not in done.stdout
    saved = json.loads((tmp_path / "stopped.json").read_text())
    assert saved["extra"]["partial"] is True and saved["rows"][0]["name"] == "first row"
