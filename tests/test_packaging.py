"""The wheel ships ``passes/`` as ``karma_fx.passes`` and never as a top-level ``passes`` package, and carries
its license, the PEP 561 ``py.typed`` marker and the classifiers an index shows.

Builds the wheel from this checkout, installs it (without dependencies) into a fresh virtual environment
outside the repository, and imports it there; the dependencies (torch, …) come from the running
interpreter's site-packages through PYTHONPATH, which does not process ``.pth`` files, so this checkout's
editable install cannot leak in.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_passes_inside_the_karma_fx_namespace(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(REPO)], check=True, cwd=tmp_path, timeout=300)
    (wheel,) = wheels.glob("karma_fx-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    assert "karma_fx/passes/capture.py" in files and "karma_fx/passes/liveness.py" in files
    assert not any(f.startswith("passes/") for f in files), "a top-level `passes` package would leak"
    assert any(f.endswith("entry_points.txt") for f in files)
    assert "karma_fx/py.typed" in files  # without it type checkers ignore our annotations
    licenses = [f for f in files if ".dist-info/" in f and f.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses and b"BSD 3-Clause" in zipfile.ZipFile(wheel).read(licenses[0])
    metadata = zipfile.ZipFile(wheel).read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    for line in ("Classifier: License :: OSI Approved :: BSD License", "Classifier: Typing :: Typed",
                 "Classifier: Programming Language :: Python :: 3.12"):
        assert line in metadata.splitlines()
    assert "BSD-3-Clause" in metadata

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300, cwd=tmp_path)
    deps = os.pathsep.join([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()])
    probe = (
        "import importlib.util, karma_fx, karma_fx.passes, karma_fx.passes.capture as c; "
        "print(karma_fx.passes.__file__); "
        "print(importlib.util.find_spec('passes'))"
    )
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": deps}, timeout=300).stdout.split("\n")
    assert out[0].startswith(str(env_dir)), out
    assert out[1] == "None"
    script = env_dir / "bin" / "karma-fx"
    assert script.exists()
