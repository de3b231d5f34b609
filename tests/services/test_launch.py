import shutil
import subprocess
import sys
from pathlib import Path


def test_console_script_reports_its_version_and_runs_the_radix_demo():
    script = shutil.which("radixserve") or str(Path(sys.executable).parent / "radixserve")
    assert subprocess.run(
        [script, "--version"], capture_output=True, text=True, check=True
    ).stdout.startswith("radixserve 0.1.0")
    demo = subprocess.run([script, "radix-demo"], capture_output=True, text=True, check=True).stdout
    assert "lock_ref=1" in demo and "protected: 5" in demo
