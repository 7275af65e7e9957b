"""The rendezvous server: set and get, bounded waits, and clients without the
job's secret, with garbage or with oversized frames refused and logged while
the job's own clients are still served; a flood of connections that never log
in leaves the server's memory, threads and log bounded."""

import hashlib
import hmac
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from keras_ring.core._rendezvous import MAX_LOGIN_FRAME_BYTES, RendezvousClient, RendezvousServer

SECRET = b"the job's secret"


def _recv_exact(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class Client:
    """The protocol's client side, written from the module's docstring."""

    def __init__(self, address, secret=SECRET, role=b"rank 0"):
        self.sock = socket.create_connection(address, timeout=10)
        hello = self.recv_frame()
        assert hello[:4] == b"KRS1" and len(hello) == 36
        nonce_s, nonce_c = hello[4:], os.urandom(32)
        mac_c = hmac.new(secret, b"keras-ring store client" + nonce_s + nonce_c + role,
                         hashlib.sha256).digest()
        self.send_frame(b"KRS1" + nonce_c + mac_c + role)
        proof = self.recv_frame()
        mac_s = hmac.new(secret, b"keras-ring store server" + nonce_s + nonce_c + role,
                         hashlib.sha256).digest()
        self.authenticated = proof is not None and hmac.compare_digest(proof, mac_s)

    def send_frame(self, payload):
        self.sock.sendall(struct.pack("!I", len(payload)) + payload)

    def recv_frame(self):
        """A frame's payload, or None once the server has closed the connection."""
        try:
            header = _recv_exact(self.sock, 4)
        except ConnectionResetError:
            return None
        if header is None:
            return None
        return _recv_exact(self.sock, struct.unpack("!I", header)[0])

    def set(self, key, value):
        self.send_frame(b"S" + struct.pack("!H", len(key)) + key + value)
        assert self.recv_frame() == b"\x00"

    def get(self, key, timeout_ms):
        """The value, or None if it was not set in time."""
        self.send_frame(b"G" + struct.pack("!IH", timeout_ms, len(key)) + key)
        reply = self.recv_frame()
        assert reply[:1] in (b"\x00", b"\x01")
        return reply[1:] if reply[:1] == b"\x00" else None

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


@pytest.fixture
def server():
    with RendezvousServer(SECRET) as s:
        yield s


def assert_closed_by_server(sock):
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


def test_set_then_get(server):
    with Client(server.address) as c:
        assert c.authenticated
        c.set(b"tcp_world/0", b"127.0.0.1:1234")
        assert c.get(b"tcp_world/0", 0) == b"127.0.0.1:1234"
        c.set(b"tcp_world/0", b"")
        assert c.get(b"tcp_world/0", 0) == b""


def test_get_waits_for_a_set_by_another_client(server):
    def later():
        time.sleep(0.1)
        with Client(server.address, role=b"rank 1") as c:
            c.set(b"k", b"v")

    setter = threading.Thread(target=later)
    setter.start()
    with Client(server.address) as c:
        assert c.get(b"k", 10000) == b"v"
    setter.join()


def test_get_times_out(server):
    with Client(server.address) as c:
        start = time.monotonic()
        assert c.get(b"never", 200) is None
        assert 0.2 <= time.monotonic() - start < 5


def test_client_without_the_secret_is_refused_and_logged(server, capsys):
    with Client(server.address, secret=b"another job's secret") as intruder:
        assert not intruder.authenticated
        port = intruder.sock.getsockname()[1]
    err = capsys.readouterr().err
    assert f"refused a connection from 127.0.0.1:{port}: it does not hold the job's secret" in err
    with Client(server.address) as c:
        assert c.authenticated
        c.set(b"a", b"b")
        assert c.get(b"a", 0) == b"b"


def test_garbage_is_refused_and_logged(server, capsys):
    with socket.create_connection(server.address, timeout=10) as s:
        port = s.getsockname()[1]
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert_closed_by_server(s)
    err = capsys.readouterr().err
    assert f"refused a connection from 127.0.0.1:{port}: it announced a handshake frame of" in err
    with Client(server.address) as c:
        assert c.authenticated


def test_a_handshake_frame_longer_than_a_handshake_is_refused_before_it_is_read(server, capsys):
    # A real handshake is at most MAX_LOGIN_FRAME_BYTES; a longer one is refused at its header.
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(struct.pack("!I", MAX_LOGIN_FRAME_BYTES + 1))
        assert_closed_by_server(s)
    assert (f"a handshake frame of {MAX_LOGIN_FRAME_BYTES + 1} bytes; a handshake has at most "
            f"{MAX_LOGIN_FRAME_BYTES}") in capsys.readouterr().err


def test_malformed_request_drops_the_connection(server, capsys):
    with Client(server.address, role=b"rank 5") as c:
        assert c.authenticated
        c.send_frame(b"X")
        assert c.recv_frame() is None
    assert "dropped the connection of rank 5 from 127.0.0.1:" in capsys.readouterr().err


def test_silent_client_is_refused_while_others_are_served(capsys):
    with RendezvousServer(SECRET, handshake_timeout=0.3) as server:
        with socket.create_connection(server.address, timeout=10) as silent:
            with Client(server.address) as c:
                c.set(b"k", b"v")
                assert c.get(b"k", 0) == b"v"
            assert_closed_by_server(silent)
    assert "it did not log in within 0.3 s" in capsys.readouterr().err


def test_stop_ends_a_waiting_get():
    server = RendezvousServer(SECRET)
    server.start()
    replies = []
    with Client(server.address) as c:
        c.send_frame(b"G" + struct.pack("!IH", 60000, 5) + b"never")
        waiter = threading.Thread(target=lambda: replies.append(c.recv_frame()))
        waiter.start()
        time.sleep(0.1)
        start = time.monotonic()
        server.stop()
        waiter.join()
    assert time.monotonic() - start < 5
    assert replies in ([None], [b"\x01"])


def test_secret_is_validated():
    with pytest.raises(TypeError, match="secret must be bytes"):
        RendezvousServer("a string")
    with pytest.raises(ValueError, match="secret must not be empty"):
        RendezvousServer(b"")
    with pytest.raises(ValueError, match="Received: handshake_timeout=0"):
        RendezvousServer(SECRET, handshake_timeout=0)


# In-process access, as the elastic driver uses it.


def test_the_serving_process_reads_what_clients_set_and_clients_read_what_it_sets(server):
    assert server.get("elastic/ready/a:0:0") is None
    with Client(server.address) as c:
        c.set(b"elastic/ready/a:0:0", b'{"request": 0}')
        assert server.get("elastic/ready/a:0:0") == b'{"request": 0}'
        server.set("elastic/assign/a:0:0/0", b'{"rank": 0}')
        assert c.get(b"elastic/assign/a:0:0/0", 0) == b'{"rank": 0}'
        server.set("elastic/assign/a:0:0/0", b"")
        assert c.get(b"elastic/assign/a:0:0/0", 0) == b""


def test_a_set_in_process_wakes_a_client_waiting_for_it(server):
    replies = []
    with Client(server.address) as c:
        waiter = threading.Thread(target=lambda: replies.append(c.get(b"late", 60000)))
        waiter.start()
        server.set("late", b"v")
        waiter.join(timeout=30)
    assert replies == [b"v"]


def test_keys_under_a_prefix(server):
    with Client(server.address) as c:
        c.set(b"elastic/ready/b", b"1")
        c.set(b"world.0/rank/0", b"x")
        c.set(b"\xff\xfe", b"not text")
    server.set("elastic/ready/a", b"2")
    assert server.keys("elastic/ready/") == ["elastic/ready/a", "elastic/ready/b"]
    assert server.keys("elastic/assign/") == []
    assert server.keys() == ["elastic/ready/a", "elastic/ready/b", "world.0/rank/0"]


def test_wait_for_change_returns_on_a_set_or_after_its_timeout(server):
    seen = server.changes
    start = time.monotonic()
    assert server.wait_for_change(seen, 0.2) == seen
    assert 0.2 <= time.monotonic() - start < 5
    assert server.wait_for_change(seen, 0) == seen

    def later():
        time.sleep(0.1)
        with Client(server.address) as c:
            c.set(b"k", b"v")

    setter = threading.Thread(target=later)
    setter.start()
    assert server.wait_for_change(seen, 60) == seen + 1
    setter.join()
    # A change that came before the call: at once.
    server.set("k", b"w")
    assert server.wait_for_change(seen + 1, 60) == seen + 2


def test_wait_for_change_ends_when_the_server_stops():
    server = RendezvousServer(SECRET)
    server.start()
    seen = server.changes
    stopper = threading.Timer(0.1, server.stop)
    stopper.start()
    start = time.monotonic()
    assert server.wait_for_change(seen, 60) == seen
    assert time.monotonic() - start < 30
    stopper.join()


def test_set_in_process_is_checked_as_a_clients_set():
    with RendezvousServer(SECRET, max_store_bytes=64) as server:
        with pytest.raises(TypeError, match="Received: value of type str"):
            server.set("k", "text")
        with pytest.raises(ValueError, match="Received: a key of 0 bytes"):
            server.set("", b"v")
        with pytest.raises(ValueError, match="Received: a key of 513 bytes"):
            server.set("k" * 513, b"v")
        with pytest.raises(ValueError, match="the store is full: it holds at most 64 bytes"):
            server.set("k", b"v" * 64)
        server.set("k", b"v" * 32)
        assert server.get("k") == b"v" * 32


# Connections that never log in.


def _connect_from(address, source):
    """A connection to `address` from the loopback address `source` (127.0.0.0/8)."""
    return socket.create_connection(address, timeout=10, source_address=(source, 0))


def test_past_the_bound_per_address_the_oldest_login_from_that_address_is_dropped(capsys):
    with RendezvousServer(SECRET, max_logins_per_address=3) as server:
        elsewhere = _connect_from(server.address, "127.0.0.1")
        idle = [_connect_from(server.address, "127.0.0.2") for _ in range(3)]
        port = idle[0].getsockname()[1]
        newest = _connect_from(server.address, "127.0.0.2")
        assert_closed_by_server(idle[0])  # the oldest from 127.0.0.2, and only it
        with Client(server.address) as c:  # from 127.0.0.1, with one idle login there
            assert c.authenticated
        for sock in idle[1:] + [newest, elsewhere]:
            sock.setblocking(False)
            assert sock.recv(64)[4:8] == b"KRS1"  # greeted and still open
            with pytest.raises(BlockingIOError):
                sock.recv(1)
        for sock in idle + [newest, elsewhere]:
            sock.close()
    assert (f"refused a connection from 127.0.0.2:{port}: it was one of more than 3 "
            "connections logging in at once from its address") in capsys.readouterr().err


def test_past_the_bound_in_all_the_oldest_login_is_dropped(capsys):
    with RendezvousServer(SECRET, max_logins=4) as server:
        idle = [_connect_from(server.address, f"127.0.0.{2 + i}") for i in range(4)]
        with Client(server.address) as c:
            assert c.authenticated
        assert_closed_by_server(idle[0])
        for sock in idle:
            sock.close()
    assert "it was one of more than 4 connections logging in at once" in capsys.readouterr().err


def test_refusals_after_the_first_are_counted_on_one_line(capsys):
    with RendezvousServer(SECRET, log_interval=600) as server:
        for _ in range(20):
            with Client(server.address, secret=b"wrong") as intruder:
                assert not intruder.authenticated
        with socket.create_connection(server.address, timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert_closed_by_server(s)
        with Client(server.address) as c:
            assert c.authenticated
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("it does not hold the job's secret")
    assert "refused 20 more connections in the last" in lines[1]
    assert "(19 without the secret; 1 not a handshake), from 127.0.0.1 (20)" in lines[1]


def _status(pid):
    """{field: value} of /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)


def _flood(address, huge_frames, idle, sources):
    """Connections that never log in: `huge_frames` that each announce a 1 MiB handshake
    frame and send all of it but its last byte, and `idle` that send nothing, spread over
    the `sources` addresses."""
    socks = []
    payload = struct.pack("!I", 1 << 20) + b"\0" * ((1 << 20) - 1)
    for i in range(huge_frames + idle):
        try:
            s = _connect_from(address, sources[i % len(sources)])
        except OSError:
            continue  # the backlog is full for a moment: the server is dropping logins
        socks.append(s)
        if i < huge_frames:
            s.settimeout(0.5)
            try:
                s.sendall(payload)
            except OSError:
                pass  # refused at the frame's header, closed while we send the rest
    return socks


@pytest.mark.timeout(120)
def test_a_flood_of_connections_that_never_log_in_leaves_the_server_bounded_and_serving(
        tmp_path):
    # The store runs as the launcher runs it: in a process of its own (of the installed build).
    server = subprocess.Popen([sys.executable, "-c", "from keras_ring.core import _rendezvous; "
                               "_rendezvous._serve_until_stdin_closes()"], cwd=tmp_path,
                              env={**os.environ, "KERAS_RING_SECRET": SECRET.hex()},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    socks = []
    try:
        host, _, port = server.stdout.readline().strip().rpartition(":")
        address = (host, int(port))
        with RendezvousClient(f"{host}:{port}", SECRET, "rank 0", timeout=10) as rank:
            rank.set("before", b"1")
        before = _status(server.pid)
        socks = _flood(address, huge_frames=300, idle=2000,
                       sources=[f"127.0.0.{i}" for i in range(1, 9)])
        during = _status(server.pid)
        # A rank logs in, sets and gets while the idle connections are still open.
        with RendezvousClient(f"{host}:{port}", SECRET, "rank 1", timeout=10) as rank:
            rank.set("during", b"2")
            assert rank.get("before", timeout=1) == b"1"
            assert rank.get("during", timeout=1) == b"2"
    finally:
        for s in socks:
            s.close()
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    rss_mib = (int(during["VmRSS"].split()[0]) - int(before["VmRSS"].split()[0])) / 1024
    assert int(during["Threads"]) <= int(before["Threads"]), (before["Threads"],
                                                               during["Threads"])
    assert rss_mib < 16, f"the server grew by {rss_mib:.0f} MiB under the flood"
    lines = err.splitlines()
    assert len(lines) <= 4, err  # the first refusal, then counts (one a log interval, one at stop)
    assert "more connections in the last" in lines[-1]
