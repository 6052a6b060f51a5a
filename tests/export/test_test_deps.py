"""scripts/test-deps.sh: the one place that installs the suite's non-Python tools (prometheus, promtool),
called by both `make test` and .ci/run. Run here against fake `id`, `sudo` and `apt-get` on a PATH of
their own, so nothing is installed and the machine's own sudo or root does not matter."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test-deps.sh"
INSTALL_COMMAND = "sudo sh -c 'apt-get update -q && apt-get install -y -q --no-install-recommends prometheus'"


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def run_script(bin_dir: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    bash = shutil.which("bash")
    assert bash is not None
    start = time.monotonic()
    # PATH holds only the fakes: no real sudo, apt-get, prometheus or promtool can be found
    proc = subprocess.run([bash, str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True,
                          timeout=60)
    return proc, time.monotonic() - start


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    env, chmod = shutil.which("env"), shutil.which("chmod")
    assert env is not None and chmod is not None
    (d / "env").symlink_to(env)  # the script runs apt-get through env (DEBIAN_FRONTEND)
    # nginx present, whether or not this machine's /usr/sbin (which the script adds to PATH) has one: these
    # tests are about installing prometheus
    fake(d, "nginx", "exit 0")
    # an apt-get that only records its arguments (so a test sees whether, and how, it was called) and
    # installs fake binaries when asked to install prometheus
    fake(d, "apt-get", f'echo "$*" >> {tmp_path}/apt.log\n'
                       f'case "$*" in *install*prometheus*) for b in prometheus promtool; do '
                       f'echo "#!/bin/sh" > {d}/$b; {chmod} +x {d}/$b; done;; esac')
    return d


def test_make_test_and_ci_run_call_the_script() -> None:
    make = shutil.which("make")
    assert make is not None, "make is needed to run the suite (`make test`)"
    # -n prints the recipe without running it; VENV elsewhere so the venv stamp cannot be satisfied by
    # a local .venv and every step of the target is listed
    dry = subprocess.run([make, "-n", "-C", str(ROOT), "test", "VENV=/nonexistent-venv"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    deps = [i for i, line in enumerate(dry) if line.strip() == "scripts/test-deps.sh"]
    pytest_runs = [i for i, line in enumerate(dry) if "-m pytest" in line]
    assert deps and pytest_runs and deps[0] < pytest_runs[0], dry
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.strip().startswith("#")]
    assert "scripts/test-deps.sh" in ci and "make test" in ci
    assert ci.index("scripts/test-deps.sh") < ci.index("make test")
    assert not any("apt-get" in line for line in ci), "the install logic lives in scripts/test-deps.sh only"


def test_without_root_or_sudo_it_stops_at_once_printing_the_command(bin_dir: Path, tmp_path: Path) -> None:
    fake(bin_dir, "id", "echo 1000")
    proc, seconds = run_script(bin_dir)
    assert proc.returncode != 0
    assert INSTALL_COMMAND in proc.stderr
    assert seconds < 10
    assert not (tmp_path / "apt.log").exists()  # nothing was attempted


def test_a_sudo_that_wants_a_password_is_not_waited_for(bin_dir: Path, tmp_path: Path) -> None:
    fake(bin_dir, "id", "echo 1000")
    # sudo -n fails where a password would be asked; a plain sudo here would block on the prompt
    fake(bin_dir, "sudo", 'if [ "$1" = -n ]; then exit 1; fi; sleep 600')
    proc, seconds = run_script(bin_dir)
    assert proc.returncode != 0 and INSTALL_COMMAND in proc.stderr
    assert seconds < 10
    assert not (tmp_path / "apt.log").exists()


def test_as_root_it_installs_the_debian_package(bin_dir: Path, tmp_path: Path) -> None:
    fake(bin_dir, "id", "echo 0")
    proc, _ = run_script(bin_dir)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls == ["update -q", "install -y -q --no-install-recommends prometheus"]
    # now both binaries are there: a second run does nothing
    proc, _ = run_script(bin_dir)
    assert proc.returncode == 0
    assert len((tmp_path / "apt.log").read_text().splitlines()) == 2


def test_with_passwordless_sudo_it_installs_through_sudo(bin_dir: Path, tmp_path: Path) -> None:
    fake(bin_dir, "id", "echo 1000")
    # records its arguments and runs the command (`true` is no file on this PATH: answered here)
    fake(bin_dir, "sudo", f'echo "sudo $*" >> {tmp_path}/sudo.log; [ "$1" = -n ] && shift\n'
                          '[ "$1" = true ] && exit 0; exec "$@"')
    proc, _ = run_script(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "apt.log").read_text().splitlines()[-1] == "install -y -q --no-install-recommends prometheus"
    assert any("apt-get install" in line for line in (tmp_path / "sudo.log").read_text().splitlines())
