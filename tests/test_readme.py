"""The README's quickstart runs as written: its Python block (the one after ``<!-- quickstart -->``) is
executed in a fresh interpreter at one thread, and what it prints has the lines the README shows after
``<!-- quickstart-output -->`` (numbers aside: they depend on the CPU and the thread count)."""
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def block_after(marker: str, text: str) -> str:
    """The body of the first fenced code block after the line `marker`."""
    lines = text.splitlines()
    assert lines.count(marker) == 1, f"README.md needs exactly one {marker} line"
    rest = lines[lines.index(marker) + 1:]
    start = next(i for i, line in enumerate(rest) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(rest)) if rest[i].startswith("```"))
    return "\n".join(rest[start + 1:end]) + "\n"


def shape(line: str) -> str:
    """A printed line with its numbers blanked out."""
    return re.sub(r"\d+(\.\d+)?", "#", line.strip())


def test_readme_quickstart_runs_and_prints_what_the_readme_shows(tmp_path):
    text = README.read_text()
    code, shown = block_after("<!-- quickstart -->", text), block_after("<!-- quickstart-output -->", text)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.strip()]
    assert [shape(line) for line in printed] == [shape(line) for line in shown.splitlines() if line.strip()], \
        done.stdout
