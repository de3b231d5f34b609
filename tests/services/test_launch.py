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


def test_keys_makes_a_private_directory_that_every_role_can_load(tmp_path: Path):
    from services.ipc import WIRE_ROLES, WireKeys

    script = shutil.which("radixserve") or str(Path(sys.executable).parent / "radixserve")
    keys_dir = tmp_path / "wire" / "keys"
    out = subprocess.run(
        [script, "keys", str(keys_dir)], capture_output=True, text=True, check=True
    ).stdout
    assert str(keys_dir) in out
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    loaded = [WireKeys.load(keys_dir, role) for role in WIRE_ROLES]
    assert len({keys.secret for keys in loaded}) == len(WIRE_ROLES)
    # A rerun (an init container run again) keeps what running processes loaded; a role
    # whose files are gone gets new ones.
    (keys_dir / "worker.key_secret").unlink()
    subprocess.run([script, "keys", str(keys_dir)], capture_output=True, check=True)
    again = {role: WireKeys.load(keys_dir, role) for role in WIRE_ROLES}
    for before in loaded:
        if before.role == "worker":
            assert again["worker"].secret != before.secret
        else:
            assert again[before.role].secret == before.secret
