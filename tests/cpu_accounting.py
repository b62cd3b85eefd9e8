"""CPU seconds per test, over the whole process tree a test keeps busy.

The suite is bound by CPU, not by waiting: its multi-process tests keep both cores of a
small machine busy (docs/testing.md), so a wall-clock duration says little about what a
test costs the run (a world-4 test on two cores shows half its CPU as wall time, and any
other load on the machine stretches it further). This plugin measures what the run pays:

    AUTOPAR_TEST_CPU=cpu.tsv python -m pytest -q
    python tests/cpu_accounting.py cpu.tsv          # per file, most CPU first

For each test, from the start of its setup to the end of its teardown, the CPU time
(user + system) of the pytest process and every process below it: the fork servers, the
pools' rank workers, forked scripts, and the children those have already reaped (a
process's reaped children count in its own figures, so a rank worker that ended inside the
test still counts through the fork server that reaped it). The file holds one line per
test: CPU seconds, wall seconds, node id, tab-separated.

Linux only (it reads /proc). tests/conftest.py registers it when AUTOPAR_TEST_CPU names
the output file; without it nothing is registered.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds (user + system, own and reaped children's) of `root` (default: this
    process) and every live process below it."""
    children: dict[int, list[int]] = defaultdict(list)
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended while we listed
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        children[int(fields[1])].append(int(entry))  # ppid
        cpu[int(entry)] = sum(int(x) for x in fields[11:15]) / _TICK  # utime..cstime
    total, todo = 0.0, [os.getpid() if root is None else root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


class CpuAccounting:
    """A pytest plugin object: CPU and wall seconds per test, written at the session's end."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[list] = []

    def pytest_runtest_logstart(self, nodeid, location):
        self.rows.append([nodeid, tree_cpu_s(), time.perf_counter()])

    def pytest_runtest_logfinish(self, nodeid, location):
        row = self.rows[-1]
        row[1] = tree_cpu_s() - row[1]
        row[2] = time.perf_counter() - row[2]

    def pytest_sessionfinish(self, session, exitstatus):
        with open(self.path, "w") as f:
            for nodeid, cpu, wall in self.rows:
                f.write(f"{cpu:.2f}\t{wall:.2f}\t{nodeid}\n")


def by_file(path: str) -> list[tuple[float, float, str]]:
    """(CPU s, wall s, file) per test file of a written table, most CPU first."""
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    with open(path) as f:
        for line in f:
            c, w, nodeid = line.rstrip("\n").split("\t")
            name = nodeid.split("::")[0]
            cpu[name] += float(c)
            wall[name] += float(w)
    return sorted(((cpu[k], wall[k], k) for k in cpu), reverse=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/cpu_accounting.py TABLE.tsv", file=sys.stderr)
        return 2
    rows = by_file(argv[0])
    total_cpu = sum(r[0] for r in rows)
    total_wall = sum(r[1] for r in rows)
    print(f"{'CPU s':>9} {'wall s':>9} {'share':>6}  file")
    for c, w, name in rows:
        print(f"{c:9.1f} {w:9.1f} {c / max(total_cpu, 1e-9):6.1%}  {name}")
    print(f"{total_cpu:9.1f} {total_wall:9.1f} {'':>6}  all ({len(rows)} files; "
          f"{total_cpu / max(total_wall, 1e-9):.2f} CPUs busy on average)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
