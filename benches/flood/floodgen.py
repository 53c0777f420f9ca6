#!/usr/bin/env python3
"""The flood benchmark's helpers, each a process of its own (benches/flood/bench.py starts them):

  gen KIND TARGET PUBKEY RATE SECONDS [SIZE [GSO]]
                                        sends WireGuard messages of KIND to TARGET (host:port) at RATE
                                        per second (0: as fast as it can) with sendmmsg(2) in batches,
                                        GSO messages per send (UDP_SEGMENT: trains the receiver's
                                        UDP_GRO socket takes in one piece, as a NIC's GRO would
                                        coalesce them), counts what comes back, prints one JSON line
  sink PORT SECONDS                     binds a UDP port and never reads it (the generator's ceiling)
  neighbour SECONDS                     a busy loop: prints how many iterations per second it made

KIND: init (handshake initiations with a valid mac1 for PUBKEY: anyone can make them from the public
key), data (data messages with unknown receiver indices), cookie (cookie replies to unknown indices).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import socket
import struct
import sys
import time

POOL = 1024  # distinct messages, sent round-robin
BATCH_MAX = 64


def mac1(responder_pub: bytes, msg: bytes) -> bytes:
    """WireGuard's mac1: BLAKE2s-128 keyed with BLAKE2s-256("mac1----" || responder public key),
    over the message up to mac1."""
    key = hashlib.blake2s(b"mac1----" + responder_pub).digest()
    return hashlib.blake2s(msg, key=key, digest_size=16).digest()


def initiation(responder_pub: bytes) -> bytes:
    """A handshake initiation (148 bytes) with random sender index, ephemeral, encrypted static and
    timestamp: mac1 is valid (so the responder does the Diffie-Hellman, or answers with a cookie
    under load), the rest fails to decrypt."""
    body = struct.pack("<I", 1) + os.urandom(4) + os.urandom(32) + os.urandom(48) + os.urandom(28)
    return body + mac1(responder_pub, body) + bytes(16)


def data(size: int) -> bytes:
    """A transport data message (type 4) to a receiver index nobody holds."""
    return struct.pack("<I", 4) + os.urandom(4) + struct.pack("<Q", 0) + os.urandom(max(16, size - 16))


def cookie() -> bytes:
    """A cookie reply (type 3, 64 bytes) to a receiver index nobody holds."""
    return struct.pack("<I", 3) + os.urandom(4) + os.urandom(24) + os.urandom(32)


class IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class MsgHdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32), ("msg_iov", ctypes.POINTER(IoVec)),
                ("msg_iovlen", ctypes.c_size_t), ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", MsgHdr), ("msg_len", ctypes.c_uint)]


SOL_UDP, UDP_SEGMENT = 17, 103


def gen(kind: str, target: str, pub_b64: str, rate: float, seconds: float, size: int, gso: int) -> dict:
    import base64

    pub = base64.b64decode(pub_b64)
    make = {"init": lambda: initiation(pub), "data": lambda: data(size), "cookie": cookie}[kind]
    pool = [make() for _ in range(POOL)]
    msg_len = len(pool[0])
    gso = max(1, min(64, gso, 65000 // msg_len))
    # One send carries `gso` messages of the pool back to back; the kernel cuts it at msg_len.
    sends = [b"".join(pool[i:i + gso]) for i in range(0, POOL - gso + 1, gso)]
    # The sends twice over, so a batch starting anywhere in the first copy is contiguous.
    bufs = [ctypes.create_string_buffer(p, len(p)) for p in sends]
    n = 2 * len(sends)
    iovs = (IoVec * n)()
    msgs = (MMsgHdr * n)()
    for i in range(n):
        b = bufs[i % len(sends)]
        iovs[i].iov_base = ctypes.addressof(b)
        iovs[i].iov_len = len(sends[i % len(sends)])
        msgs[i].msg_hdr.msg_iov = ctypes.pointer(iovs[i])
        msgs[i].msg_hdr.msg_iovlen = 1
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    sendmmsg = libc.sendmmsg
    sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    host, port = target.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.connect((host, int(port)))
    if gso > 1:
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, msg_len)
    sock.setblocking(False)
    fd = sock.fileno()
    msize = ctypes.sizeof(MMsgHdr)
    base = ctypes.addressof(msgs)
    # Paced in bursts of about a millisecond's worth (1 to BATCH_MAX sends of `gso` messages).
    batch = BATCH_MAX if rate <= 0 else max(1, min(BATCH_MAX, int(rate / 1000 / gso)))
    sent = replies = errors = 0
    reply_sizes: dict[int, int] = {}
    rbuf = bytearray(2048)
    pos = 0
    t0 = time.monotonic()
    end = t0 + seconds
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if rate > 0:
            due = int((now - t0) * rate) - sent
            if due < gso:
                time.sleep(min(end - now, max(0.0002, (sent + gso) / rate - (now - t0))))
                continue
            k = min(due // gso, batch)
        else:
            k = batch
        r = sendmmsg(fd, base + pos * msize, k, 0)
        if r > 0:
            sent += r * gso
            pos = (pos + r) % len(sends)
        else:
            errors += 1
            if rate <= 0:
                time.sleep(0.0001)
        # What the target sends back (cookie replies to initiations under load, ...).
        for _ in range(256):
            try:
                got = sock.recv_into(rbuf)
            except (BlockingIOError, ConnectionRefusedError):
                break
            replies += 1
            reply_sizes[got] = reply_sizes.get(got, 0) + 1
    wall = time.monotonic() - t0
    time.sleep(0.1)
    while True:
        try:
            got = sock.recv_into(rbuf)
        except (BlockingIOError, ConnectionRefusedError):
            break
        replies += 1
        reply_sizes[got] = reply_sizes.get(got, 0) + 1
    return {"kind": kind, "sent": sent, "seconds": round(wall, 3), "pps": round(sent / wall) if wall else 0, "offered_pps": rate,
            "send_errors": errors, "replies": replies, "reply_sizes": reply_sizes, "batch": batch, "gso": gso, "bytes": msg_len}


def sink(port: int, seconds: float) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    print("listening", flush=True)
    time.sleep(seconds)
    return {"port": port}


def neighbour(seconds: float) -> dict:
    """A normal-priority busy loop: iterations per second of wall time, and its CPU share."""
    n = 0
    t0 = time.monotonic()
    c0 = time.thread_time()
    end = t0 + seconds
    while True:
        for _ in range(20000):
            n += 1
        if time.monotonic() >= end:
            break
    wall = time.monotonic() - t0
    return {"iterations_per_s": n / wall, "cpu_share": round((time.thread_time() - c0) / wall, 4), "seconds": round(wall, 3)}


def main() -> int:
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    a = sys.argv[2:]
    if cmd == "gen" and len(a) in (5, 6, 7):
        out = gen(a[0], a[1], a[2], float(a[3]), float(a[4]), int(a[5]) if len(a) >= 6 else 64, int(a[6]) if len(a) == 7 else 1)
    elif cmd == "sink" and len(a) == 2:
        out = sink(int(a[0]), float(a[1]))
    elif cmd == "neighbour" and len(a) == 1:
        out = neighbour(float(a[0]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
