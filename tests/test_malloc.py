"""`node.malloc`: a peer has glibc keep freed buffers for reuse, unless the user set malloc's thresholds."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

PROBE = "from p2ptrain.node.malloc import keep_freed_memory; print(keep_freed_memory())"


def kept(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def test_glibc_takes_the_thresholds():
    assert kept() == "True"


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
                                 {"MALLOC_MMAP_THRESHOLD_": "1048576"}])
def test_the_users_own_malloc_settings_are_left_alone(env: dict[str, str]):
    assert kept(**env) == "False"
