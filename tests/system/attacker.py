"""An attacker that knows every address of a job but not its token (tests/system/test_attacker.py).

    python3 attacker.py --seconds S [--tcp HOST:PORT ...] [--udp HOST:PORT ...]

For S seconds, against every TCP target: garbage, frame headers that claim a 1 GiB payload (in
the rail's and the bootstrap's framing), well-formed rail hellos whose MAC is forged (claiming a
high epoch, to take over a rail), and idle connections held open to the end; against every UDP
target (the probe ports): forged probe requests and replies with random tags.  Prints one line of
counts at the end.  Every loop is bounded in count and time.
"""

import argparse
import os
import random
import socket
import struct
import time

# magic, op, flags, imm, key, offset, length, CRC-32C of the rest, cookie (runtime/providers/tcp/frame.h)
TCP_FRAME = struct.Struct("<HBBIQQIIQ")
RAIL_MAGIC = 0x3252
OP_HELLO = 1
BOOTSTRAP_HEADER = struct.Struct("<IHHI")  # magic "R2BS", type, version, length
PROBE = struct.Struct("<IBBHQQQIIQQ")  # the 56-byte probe datagram


def _crc32c_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC32C = _crc32c_table()


def rail_header(op, length):
    """A rail frame header with its checksum, so that the rail reads on to what it claims."""
    h = TCP_FRAME.pack(RAIL_MAGIC, op, 0, 0, 0, 0, length, 0, 0)
    crc = 0xFFFFFFFF
    for b in h[:28] + h[32:]:
        crc = CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return h[:28] + struct.pack("<I", crc ^ 0xFFFFFFFF) + h[32:]


def target(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)


def connect(addr, timeout=1.0):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(addr)
        return s
    except OSError:
        s.close()
        return None


def read_some(s, n):
    try:
        return s.recv(n)
    except OSError:
        return b""


def garbage(addr, counts):
    s = connect(addr)
    if s is None:
        return
    try:
        s.sendall(os.urandom(65536))
        counts["garbage"] += 1
    except OSError:
        pass
    s.close()


def oversized(addr, counts):
    for header in (rail_header(OP_HELLO, 1 << 30),
                   BOOTSTRAP_HEADER.pack(0x53423252, 1, 2, 1 << 30)):
        s = connect(addr)
        if s is None:
            continue
        try:
            s.sendall(header + os.urandom(4096))
            counts["oversized"] += 1
        except OSError:
            pass
        s.close()


def forged_hello(addr, counts):
    s = connect(addr)
    if s is None:
        return
    read_some(s, 40 + 16)  # the challenge, if this is a rail
    body = struct.pack("<HQQII", 3, random.getrandbits(64), random.getrandbits(64), 0, 99)
    body += struct.pack("<I", 0)  # no description
    body += os.urandom(16) + os.urandom(32)  # a nonce and a forged MAC
    try:
        s.sendall(rail_header(OP_HELLO, len(body)) + body)
        if read_some(s, 72) == b"":
            counts["hellos refused"] += 1
        else:
            counts["hellos answered"] += 1
    except OSError:
        counts["hellos refused"] += 1
    s.close()


def probes(addr, counts, n=200):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(n):
        pkt = PROBE.pack(0x42503252, 2, random.choice((1, 2)), 0, random.getrandbits(64),
                         random.getrandbits(64), random.getrandbits(64), random.getrandbits(32),
                         random.getrandbits(2), random.getrandbits(64), time.monotonic_ns())
        try:
            u.sendto(pkt, addr)
            counts["probes"] += 1
        except OSError:
            counts["probe_errors"] += 1
    u.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--tcp", type=target, action="append", default=[])
    ap.add_argument("--udp", type=target, action="append", default=[])
    a = ap.parse_args()
    counts = {"garbage": 0, "oversized": 0, "hellos refused": 0, "hellos answered": 0, "idle": 0,
              "probes": 0, "probe_errors": 0}
    idle = []
    for addr in a.tcp:  # idle, half-open connections held to the end
        for _ in range(8):
            s = connect(addr)
            if s is not None:
                idle.append(s)
                counts["idle"] += 1
    end = time.monotonic() + a.seconds
    rounds = 0
    while time.monotonic() < end and rounds < 1000:
        rounds += 1
        for addr in a.tcp:
            garbage(addr, counts)
            oversized(addr, counts)
            forged_hello(addr, counts)
        for addr in a.udp:
            probes(addr, counts)
        time.sleep(0.05)
    for s in idle:
        s.close()
    print(" ".join(f"{k.replace(' ', '_')}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main()
