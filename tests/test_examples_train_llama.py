"""examples/train_llama.py end to end, as a user runs it (its dist resume spawns 4 processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_llama_trains_checkpoints_resumes_and_loads_hf() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "FallbackWarning" not in proc.stderr, proc.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"^step \d: loss ([\d.]+)", out, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0], out
    resumed = re.search(r"resumed on \(dp=1, tp=4\): step 2 loss ([\d.]+)", out)
    dist = re.search(r"resumed on 4 gloo processes: step 2 loss ([\d.]+)", out)
    assert resumed and dist, out
    for m in (resumed, dist):
        assert abs(float(m.group(1)) - losses[2]) < 0.02 * losses[2], out
    assert "loaded 21 tensors" in out and "P(None, 'tp')" in out
