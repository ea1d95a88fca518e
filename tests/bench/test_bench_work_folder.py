"""``noria.bench.work_folder``: a benchmark's default folder is gone when its process ends; ``--work-dir`` stays."""

import subprocess
import sys
from pathlib import Path


def test_default_folder_is_removed_at_exit_and_a_given_one_kept(tmp_path):
    given = tmp_path / "given"
    code = (
        "import sys\n"
        "from noria.bench import work_folder\n"
        "temp = work_folder(None, 'noria-bench-test-')\n"
        "(temp / 'run').mkdir(); (temp / 'run' / 'weights.bin').write_bytes(b'x' * 1024)\n"
        f"kept = work_folder({str(given)!r}, 'unused-')\n"
        "(kept / 'metrics.jsonl').write_text('{}')\n"
        "print(temp)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    temp = Path(out.stdout.strip().splitlines()[-1])
    assert temp.name.startswith("noria-bench-test-")
    assert not temp.exists()
    assert (given / "metrics.jsonl").read_text() == "{}"
