#!/usr/bin/env python3
"""The flood benchmark's helpers, each a process of its own (benches/flood/bench.py starts them):

  gen KIND TARGET PUBKEY RATE SECONDS [SIZE [GSO]]
                                        sends WireGuard messages of KIND to TARGET (host:port) at RATE
                                        per second (0: as fast as it can) with sendmmsg(2) in batches,
                                        GSO messages per send (UDP_SEGMENT: trains the receiver's
                                        UDP_GRO socket takes in one piece, as a NIC's GRO would
                                        coalesce them), counts what comes back, prints one JSON line
  sink PORT SECONDS                     binds a UDP port and never reads it (the generator's ceiling)
  neighbour SECONDS                     a busy loop: prints how many iterations per second it made,
                                        and its longest stall (the longest gap between two looks at
                                        the clock, every STALL_CHUNK iterations)

KIND: init (handshake initiations with a valid mac1 for PUBKEY: anyone can make them from the public
key), init2 (the same with a valid mac2: the generator first floods until the target answers with a
cookie reply, decrypts the cookie as an attacker that owns its source address can, and then sends
initiations that pass the cookie check), data (data messages with unknown receiver indices), cookie
(cookie replies to unknown indices).

GEN_SOURCES=ADDR,ADDR,... in the environment: the generator sends from each of these source addresses
in turn (one socket each; with init2, each fetches its own cookie).
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
STALL_CHUNK = 1000  # the neighbour's iterations between two looks at the clock
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


def _rotl(v: int, n: int) -> int:
    return ((v << n) & 0xFFFFFFFF) | (v >> (32 - n))


def _chacha_rounds(state: list[int]) -> list[int]:
    x = list(state)
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                           (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            x[a] = (x[a] + x[b]) & 0xFFFFFFFF; x[d] = _rotl(x[d] ^ x[a], 16)
            x[c] = (x[c] + x[d]) & 0xFFFFFFFF; x[b] = _rotl(x[b] ^ x[c], 12)
            x[a] = (x[a] + x[b]) & 0xFFFFFFFF; x[d] = _rotl(x[d] ^ x[a], 8)
            x[c] = (x[c] + x[d]) & 0xFFFFFFFF; x[b] = _rotl(x[b] ^ x[c], 7)
    return x


_SIGMA = list(struct.unpack("<4I", b"expand 32-byte k"))


def xchacha20_keystream(key: bytes, nonce24: bytes, counter: int) -> bytes:
    """One 64-byte block of XChaCha20's keystream (HChaCha20 subkey, then the IETF ChaCha20 block
    at `counter`): enough to open WireGuard's 16-byte encrypted cookie, whose tag is not checked
    here (a flood generator trusts its target's reply)."""
    h = _chacha_rounds(_SIGMA + list(struct.unpack("<8I", key)) + list(struct.unpack("<4I", nonce24[:16])))
    subkey = struct.pack("<8I", *(h[0:4] + h[12:16]))
    state = _SIGMA + list(struct.unpack("<8I", subkey)) + [counter] + list(struct.unpack("<3I", bytes(4) + nonce24[16:]))
    out = _chacha_rounds(state)
    return struct.pack("<16I", *((o + s) & 0xFFFFFFFF for o, s in zip(out, state)))


def open_cookie(responder_pub: bytes, reply: bytes) -> bytes:
    """The cookie in a cookie reply (type 3: index 4..8, nonce 8..32, encrypted cookie 32..48)."""
    key = hashlib.blake2s(b"cookie--" + responder_pub).digest()
    stream = xchacha20_keystream(key, reply[8:32], 1)
    return bytes(a ^ b for a, b in zip(reply[32:48], stream[:16]))


def with_mac2(msg: bytes, cookie_value: bytes) -> bytes:
    """`msg` (an initiation) with mac2 = BLAKE2s-128 keyed with the cookie, over the message up to
    mac2."""
    return msg[:132] + hashlib.blake2s(msg[:132], key=cookie_value, digest_size=16).digest()


def fetch_cookie(sock: socket.socket, responder_pub: bytes, seconds: float) -> bytes | None:
    """Sends initiations until the target answers one with a cookie reply (it does once it counts
    itself under load), and opens the cookie."""
    end = time.monotonic() + seconds
    rbuf = bytearray(2048)
    while time.monotonic() < end:
        for _ in range(64):
            try:
                sock.send(initiation(responder_pub))
            except (BlockingIOError, ConnectionRefusedError):
                break
        time.sleep(0.002)
        while True:
            try:
                got = sock.recv_into(rbuf)
            except (BlockingIOError, ConnectionRefusedError):
                break
            if got == 64 and rbuf[0] == 3:
                return open_cookie(responder_pub, bytes(rbuf[:64]))
    return None


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


class Lane:
    """One source address of a generator: its socket and its messages, ready for sendmmsg."""

    def __init__(self, kind: str, make, pub: bytes, host: str, port: int, source: str | None, gso: int):
        pool = [make() for _ in range(POOL)]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if source:
            self.sock.bind((source, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.connect((host, port))
        self.sock.setblocking(False)
        self.error = None
        if kind == "init2":
            cookie_value = fetch_cookie(self.sock, pub, 10.0)
            if cookie_value is None:
                self.error = f"no cookie reply within 10 s for source {source}"
            else:
                pool = [with_mac2(m, cookie_value) for m in pool]
        self.msg_len = len(pool[0])
        self.gso = max(1, min(64, gso, 65000 // self.msg_len))
        # One send carries `gso` messages of the pool back to back; the kernel cuts it at msg_len.
        sends = [b"".join(pool[i:i + self.gso]) for i in range(0, POOL - self.gso + 1, self.gso)]
        # The sends twice over, so a batch starting anywhere in the first copy is contiguous.
        self.bufs = [ctypes.create_string_buffer(p, len(p)) for p in sends]
        self.count = len(sends)
        n = 2 * len(sends)
        self.iovs = (IoVec * n)()
        self.msgs = (MMsgHdr * n)()
        for i in range(n):
            b = self.bufs[i % len(sends)]
            self.iovs[i].iov_base = ctypes.addressof(b)
            self.iovs[i].iov_len = len(sends[i % len(sends)])
            self.msgs[i].msg_hdr.msg_iov = ctypes.pointer(self.iovs[i])
            self.msgs[i].msg_hdr.msg_iovlen = 1
        if self.gso > 1:
            self.sock.setsockopt(SOL_UDP, UDP_SEGMENT, self.msg_len)
        self.fd = self.sock.fileno()
        self.base = ctypes.addressof(self.msgs)
        self.pos = 0


def gen(kind: str, target: str, pub_b64: str, rate: float, seconds: float, size: int, gso: int) -> dict:
    import base64

    pub = base64.b64decode(pub_b64)
    make = {"init": lambda: initiation(pub), "init2": lambda: initiation(pub), "data": lambda: data(size),
            "cookie": cookie}[kind]
    host, port = target.rsplit(":", 1)
    sources = [a for a in os.environ.get("GEN_SOURCES", "").split(",") if a] or [None]
    lanes = [Lane(kind, make, pub, host, int(port), source, gso) for source in sources]
    failed = [lane.error for lane in lanes if lane.error]
    if failed:
        return {"kind": kind, "error": "; ".join(failed)}
    msg_len, gso = lanes[0].msg_len, lanes[0].gso
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    sendmmsg = libc.sendmmsg
    sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    msize = ctypes.sizeof(MMsgHdr)
    # Paced in bursts of about a millisecond's worth (1 to BATCH_MAX sends of `gso` messages).
    batch = BATCH_MAX if rate <= 0 else max(1, min(BATCH_MAX, int(rate / 1000 / gso)))
    sent = replies = errors = 0
    reply_sizes: dict[int, int] = {}
    rbuf = bytearray(2048)
    turn = 0
    t0 = time.monotonic()
    end = t0 + seconds

    def drain(lane: Lane) -> None:
        nonlocal replies
        for _ in range(256):
            try:
                got = lane.sock.recv_into(rbuf)
            except (BlockingIOError, ConnectionRefusedError):
                break
            replies += 1
            reply_sizes[got] = reply_sizes.get(got, 0) + 1

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
        # The sources take turns, a batch each.
        lane = lanes[turn % len(lanes)]
        turn += 1
        r = sendmmsg(lane.fd, lane.base + lane.pos * msize, k, 0)
        if r > 0:
            sent += r * gso
            lane.pos = (lane.pos + r) % lane.count
        else:
            errors += 1
            if rate <= 0:
                time.sleep(0.0001)
        # What the target sends back (cookie replies to initiations under load, ...).
        drain(lane)
    wall = time.monotonic() - t0
    time.sleep(0.1)
    for lane in lanes:
        drain(lane)
    return {"kind": kind, "sent": sent, "seconds": round(wall, 3), "pps": round(sent / wall) if wall else 0, "offered_pps": rate,
            "send_errors": errors, "replies": replies, "reply_sizes": reply_sizes, "batch": batch, "gso": gso, "bytes": msg_len,
            "sources": len(lanes)}


def sink(port: int, seconds: float) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    print("listening", flush=True)
    time.sleep(seconds)
    return {"port": port}


def neighbour(seconds: float) -> dict:
    """A normal-priority busy loop: iterations per second of wall time, its CPU share, and its
    stalls: the gaps between chunks of STALL_CHUNK iterations (about 30 us each when it has the
    CPU), the longest of them, and how many passed 5, 10, 20 and 40 ms. A gap is time the loop
    did not run: another thread (a reader at real-time priority, the scheduler's choice at
    normal priority), softirq, or the hypervisor held its CPU."""
    n = 0
    t0 = time.monotonic()
    c0 = time.thread_time()
    end = t0 + seconds
    prev = t0
    longest = 0.0
    gaps = []  # the longest few, in seconds
    over = {5: 0, 10: 0, 20: 0, 40: 0}
    while True:
        for _ in range(STALL_CHUNK):
            n += 1
        now = time.monotonic()
        gap = now - prev
        prev = now
        if gap > 0.002:
            gaps.append(gap)
            if len(gaps) > 64:
                gaps.sort(reverse=True)
                del gaps[8:]
            for ms in over:
                if gap * 1000 > ms:
                    over[ms] += 1
        if gap > longest:
            longest = gap
        if now >= end:
            break
    wall = time.monotonic() - t0
    gaps.sort(reverse=True)
    return {"iterations_per_s": n / wall, "cpu_share": round((time.thread_time() - c0) / wall, 4), "seconds": round(wall, 3),
            "longest_stall_ms": round(longest * 1000, 2), "stalls_ms": [round(g * 1000, 2) for g in gaps[:8]],
            "stalls_over_ms": {str(k): v for k, v in over.items()}, "chunk_iterations": STALL_CHUNK}


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
