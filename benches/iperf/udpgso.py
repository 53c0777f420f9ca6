#!/usr/bin/env python3
"""A UDP sender that uses UDP_SEGMENT (as QUIC stacks do), and a receiver with UDP_GRO, for the
iperf3 benchmark's `uso` tests (iperf3 cannot send with UDP_SEGMENT).

server PORT SECONDS: counts the bytes received from the first datagram on, until SECONDS after
    it or 1 s of silence; prints {"bytes", "seconds", "datagrams"} as JSON.
client HOST PORT SECONDS [SEGMENT]: sends 44-segment super-datagrams (SEGMENT bytes each, default
    1392) as fast as the socket takes them for SECONDS; prints {"bytes", "seconds", "sends"}.
"""

import json
import socket
import sys
import time

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
SO_RCVBUFFORCE = 33
SEGMENTS = 44


def server(port: int, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(SOL_UDP, UDP_GRO, 1)
    s.bind(("0.0.0.0", port))
    print("listening", flush=True)
    buf = bytearray(65536)
    s.settimeout(30)
    total = count = 0
    first = last = None
    while True:
        try:
            n = s.recv_into(buf)
        except socket.timeout:
            break
        now = time.monotonic()
        if first is None:
            first = now
            s.settimeout(1.0)
        total += n
        count += 1
        last = now
        if now - first > seconds:
            break
    print(json.dumps({"bytes": total, "seconds": (last - first) if first else 0, "datagrams": count}), flush=True)


def client(host: str, port: int, seconds: float, segment: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(SOL_UDP, UDP_SEGMENT, segment)
    s.connect((host, port))
    payload = b"\x00" * (segment * SEGMENTS)
    sent = sends = 0
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end:
        try:
            sent += s.send(payload)
            sends += 1
        except (BlockingIOError, ConnectionRefusedError):
            pass
    print(json.dumps({"bytes": sent, "seconds": time.monotonic() - start, "sends": sends}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]), float(sys.argv[3]))
    else:
        client(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 1392)
