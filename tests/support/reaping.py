"""A probe of whether PID 1 reaps orphans (tests/project/test_reaping.py,
tests/project/test_compose_stack.py).

``PROBE`` is a Python program: it starts a shell that starts a short ``sleep`` in the
background and exits at once, so the ``sleep`` is orphaned, handed to PID 1 of its pid
namespace, and exits 0.3 s later. It prints what became of it 2 s on: "reaped" (gone from
/proc: PID 1 waited for it) or "zombie" (PID 1 never did). Run it in a container or a pid
namespace whose PID 1 is the process under test.
"""

from __future__ import annotations

PROBE = r"""
import subprocess, time
shell = subprocess.run(["sh", "-c", "sleep 0.3 & echo $!"], capture_output=True, text=True)
orphan = int(shell.stdout)
time.sleep(2)
try:
    with open(f"/proc/{orphan}/stat") as stat:
        state = stat.read().rpartition(")")[2].split()[0]
except FileNotFoundError:
    state = "gone"
print({"gone": "reaped", "Z": "zombie"}.get(state, f"state {state}"))
"""
