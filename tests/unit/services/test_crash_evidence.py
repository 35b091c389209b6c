"""What a failed cluster test reports about processes that died during it
(tests/integration/crash_evidence.py): the kernel's kill and crash lines
since the test began, and a faulthandler report from a worker's log."""

from __future__ import annotations

import time

from tests.integration.crash_evidence import controller_lines, fatal_stacks, kernel_lines

DMESG = """\
[  100.000001] virtio_blk virtio1: [vda] new size
[  150.500000] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0
[  150.600000] Out of memory: Killed process 4242 (ray::ServeRepli) total-vm:9000000kB
[  151.000000] ray::ServeRepli[4243]: segfault at 0 ip 00007f0000000000 sp 00007ffd00000000 error 4
[  160.000000] hrtimer: interrupt took 26029 ns
"""


def test_kernel_lines_keep_the_kills_and_crashes_since_the_test_began():
    assert kernel_lines(DMESG, since_uptime_s=150.55) == [
        "[  150.600000] Out of memory: Killed process 4242 (ray::ServeRepli) total-vm:9000000kB",
        "[  151.000000] ray::ServeRepli[4243]: segfault at 0 ip 00007f0000000000 sp 00007ffd00000000 error 4"]
    assert len(kernel_lines(DMESG, since_uptime_s=0)) == 3
    assert kernel_lines(DMESG, since_uptime_s=152) == []


def test_fatal_stacks_are_cut_from_a_worker_log():
    log = "\n".join(["INFO serving", "Fatal Python error: Segmentation fault", "",
                     'Thread 0x1 (most recent call first):', '  File "x.py", line 3 in f'] + ["more"] * 100)
    stacks = fatal_stacks(log)
    assert stacks[0] == "Fatal Python error: Segmentation fault" and len(stacks) == 40
    assert fatal_stacks("INFO serving\nINFO done") == []


def test_controller_lines_keep_warnings_and_errors_since_the_test_began():
    log = ("INFO 2026-12-05 10:20:57,567 controller 1 -- Starting Replica(id='a')\n"
           "WARNING 2026-12-05 10:20:57,567 controller 1 -- Actor for Replica(id='b') crashed\n"
           "WARNING 2026-12-05 10:19:00,000 controller 1 -- older\n"
           "ERROR 2026-12-05 10:20:58,000 controller 1 -- The deployments ['decode'] are UNHEALTHY.\n")
    since = time.mktime(time.strptime("2026-12-05 10:20:00", "%Y-%m-%d %H:%M:%S"))
    assert controller_lines(log, since) == [log.splitlines()[1], log.splitlines()[3]]
