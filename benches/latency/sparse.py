#!/usr/bin/env python3
"""The sparse TCP flow of benches/latency: a request-response client and its echo server.

server PORT: accepts connections and echoes every 64-byte message back.
client HOST PORT SECONDS INTERVAL: one TCP connection (TCP_NODELAY), a 64-byte message every
INTERVAL seconds, each timed until its echo is back; prints the round trips in ms as JSON. A game,
an SSH session or an RPC sends like this: little, now and then, and waits for the answer.
"""

import json
import socket
import sys
import time

SIZE = 64


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def server(port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(4)
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                conn.sendall(recv_exact(conn, SIZE))
        except (ConnectionError, OSError):
            conn.close()


def client(host: str, port: int, seconds: float, interval: float) -> None:
    sock = socket.create_connection((host, port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(5)
    rtts, errors = [], 0
    msg = b"x" * SIZE
    end = time.monotonic() + seconds
    nxt = time.monotonic()
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            sock.sendall(msg)
            recv_exact(sock, SIZE)
            rtts.append((time.monotonic() - t0) * 1000)
        except (OSError, ConnectionError):
            errors += 1
            break
        nxt += interval
        time.sleep(max(0.0, nxt - time.monotonic()))
    print(json.dumps({"rtt_ms": [round(x, 4) for x in rtts], "errors": errors}))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        client(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
