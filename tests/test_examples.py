"""Every example runs with ``--smoke`` as a user would run it: a fresh interpreter, the installed
package, a working directory outside the repository, and prints what it promises; ``--help``
works for each. (About 25 s on 2 cores: the DDP example starts two processes.)"""
from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> patterns its --smoke output must contain
EXPECTED = {
    "train_dataparallel.py": [r"path: ThreadedDataParallel over 2 CPU replicas", r"backend: \{", r"epoch 1: loss \d+\.\d+"],
    "train_ddp.py": [
        r"starting 2 local processes", r"step +3 +loss \d+\.\d+ +\(2 ranks, gloo\)", r"identical on all 2 ranks: True",
    ],
    "one_device.py": [r"step +5 +loss \d+\.\d+", r"torch\.nn\.modules\.batchnorm\.BatchNorm2d", r"max abs difference \d"],
    "finetune_frozen.py": [r"finetune epoch 1: loss \d+\.\d+", r"running statistics unchanged"],
    "fused_and_inplace.py": [r"pairs fused", r"converted \['1', '4', '7', '10'\]", r"left alone \{'13'", r"ratio 0\.\d+"],
}


def run(script: str, *args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_smoke(script: str, tmp_path: Path) -> None:
    done = run(script, "--smoke", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    for pattern in EXPECTED[script]:
        assert re.search(pattern, done.stdout), f"{script}: no {pattern!r} in\n{done.stdout}"
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_help(script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` exits 0 and lists ``--smoke``. In this process: a fresh interpreter would
    spend seconds importing torch for each; the smoke runs above cover a fresh one."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert exited.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out and "--smoke" in out, out
    # every option says what it is, and every option with a value its default
    source = (EXAMPLES / script).read_text(encoding="utf-8")
    for call in re.findall(r"add_argument\((.*)\)", source):
        assert "help=" in call, f"{script}: an option without a description: {call}"
        if "default=" in call and "action=" not in call:
            assert "default" in call.split("help=", 1)[1], f"{script}: the help does not give the default: {call}"


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)
