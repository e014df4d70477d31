#!/usr/bin/env python3
# Silent connections against the HTTP front of examples/local (running, see docs/running.md): opens
# N TCP connections from 127.0.0.2 that never send a byte (50 at a time), and reports how
# many the front closes at once (front_limits.max_connections_per_source), when the last one
# is closed (front_limits.first_byte_timeout), and the answers and times of curl calls from
# 127.0.0.1 meanwhile (a process per call: the times include curl's start).
# Usage: python3 bench/silent-connections.py [N]      (default 2000)
import socket, subprocess, sys, time, selectors
N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
front = ("127.0.0.1", 8080)
sel = selectors.DefaultSelector()
socks = []
t0 = time.monotonic()
for i in range(N):
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    s.setblocking(False)
    try:
        s.connect(front)
    except BlockingIOError:
        pass
    socks.append(s)
    sel.register(s, selectors.EVENT_READ, i)
    if i % 50 == 49:
        time.sleep(0.01)
closed_at = {}
def poll(timeout):
    for key, _ in sel.select(timeout):
        try:
            data = key.fileobj.recv(64)
        except (ConnectionResetError, OSError):
            data = b""
        if not data:
            closed_at[key.data] = time.monotonic() - t0
            sel.unregister(key.fileobj)
t1 = time.monotonic()
while time.monotonic() - t1 < 1.0:
    poll(0.05)
early = len(closed_at)
calls = []
while len(closed_at) < N and time.monotonic() - t0 < 45:
    c0 = time.monotonic()
    r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5",
        "-H", "Authorization: Bearer dev-caller-key", "http://127.0.0.1:8080/relay/demo/hello"],
        capture_output=True, text=True)
    calls.append((r.stdout, round((time.monotonic() - c0) * 1000, 1)))
    poll(0.2)
late = sorted(v for k, v in closed_at.items())
print(f"silent connections from 127.0.0.2: {N}")
print(f"opened in {t1 - t0:.2f} s; closed within 1 s after the last connect: {early}")
print(f"closed in all: {len(closed_at)}; last closed at {late[-1]:.2f} s" if late else "none closed")
codes = {}
for c, _ in calls:
    codes[c] = codes.get(c, 0) + 1
ms = sorted(m for _, m in calls)
print(f"curl calls from 127.0.0.1 meanwhile: {len(calls)}, statuses {codes}, max {ms[-1]} ms, median {ms[len(ms)//2]} ms")
