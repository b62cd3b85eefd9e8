"""tests/cpu_accounting.py: AUTOPAR_TEST_CPU writes each test's CPU seconds, counting the
processes a test starts, not the time it waits."""

import os
import subprocess
import sys

from cpu_accounting import by_file, main

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_SAMPLE = '''
import subprocess, sys, time

def test_burns_in_a_child():
    # half a second of CPU in another process: the test's own process only waits for it
    subprocess.run([sys.executable, "-c",
                    "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.5: pass"], check=True)

def test_sleeps():
    time.sleep(0.5)
'''


def test_a_child_s_cpu_counts_and_waiting_does_not(tmp_path):
    (tmp_path / "test_sample.py").write_text(_SAMPLE)
    out = tmp_path / "cpu.tsv"
    env = dict(os.environ, AUTOPAR_TEST_CPU=str(out),
               PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    # tests/conftest.py as a plugin: the sample lies outside tests/, which holds the hook
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest",
                           "-p", "no:cacheprovider", str(tmp_path / "test_sample.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("\t")[2].split("::")[1]: [float(x) for x in line.split("\t")[:2]]
            for line in out.read_text().splitlines()}
    assert set(rows) == {"test_burns_in_a_child", "test_sleeps"}
    burn_cpu, burn_wall = rows["test_burns_in_a_child"]
    sleep_cpu, sleep_wall = rows["test_sleeps"]
    assert burn_cpu >= 0.45 and burn_wall >= burn_cpu * 0.9 - 0.05
    assert sleep_wall >= 0.5 and sleep_cpu < 0.2
    files = by_file(str(out))
    assert len(files) == 1 and files[0][2].endswith("test_sample.py")
    assert abs(files[0][0] - burn_cpu - sleep_cpu) < 0.011
    assert main([str(out)]) == 0
