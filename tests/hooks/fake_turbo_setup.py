"""setup.py of the test-made Primus-Turbo: a tiny package whose build records what it was built from.

The build writes `primus_turbo/_build_info.py` with the checkout's commit, the submodule's
version and GPU_ARCHS, and appends one line per build to $FAKE_TURBO_BUILD_COUNTER, so tests can
count builds. $FAKE_TURBO_BUILD_SLEEP makes the build slow enough to interrupt.
"""

import os
import subprocess
import time

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
COMMIT = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=HERE, text=True).strip()


class RecordingBuildPy(build_py):
    """Runs once per wheel build, like the HIP compile step of the real package."""

    def run(self):
        super().run()
        counter = os.environ.get("FAKE_TURBO_BUILD_COUNTER")
        if counter:
            with open(counter, "a") as f:
                f.write(COMMIT + "\n")
        print("compiling kernels for", os.environ["GPU_ARCHS"], flush=True)
        time.sleep(float(os.environ.get("FAKE_TURBO_BUILD_SLEEP", "0")))
        with open(os.path.join(HERE, "third_party", "ck", "VERSION")) as f:
            ck_version = f.read().strip()
        with open(os.path.join(self.build_lib, "primus_turbo", "_build_info.py"), "w") as f:
            f.write(
                f"COMMIT = {COMMIT!r}\nCK_VERSION = {ck_version!r}\nGPU_ARCHS = {os.environ['GPU_ARCHS']!r}\n"
            )


setup(
    name="primus_turbo",
    version="0.1.0+g" + COMMIT[:12],
    packages=["primus_turbo"],
    cmdclass={"build_py": RecordingBuildPy},
)
