"""The rendezvous server through which the ranks of a TCP world find each other.

The launcher runs one `RendezvousServer` per job: a key-value store on a
thread, where each rank sets its listening address and gets the others'
(the C++ client is `TcpStoreClient`, custom_ops/core/transport/tcp/store.h).
Every connection must prove it holds the job's secret before anything is
served; one that does not, or that sends garbage or oversized frames, is
refused with one line on stderr naming its address, and the job goes on.

Wire protocol. Every message is a frame: a 4-byte big-endian payload length,
then the payload, at most `MAX_FRAME_BYTES`; a connection that announces a
longer frame is dropped. A connection first authenticates:

    server -> client  b"KRS1" nonce_s[32]
    client -> server  b"KRS1" nonce_c[32] mac_c[32] role    (role: 1-256 bytes, e.g. b"rank 3")
    server -> client  mac_s[32]

    mac_c = HMAC-SHA256(secret, b"keras-ring store client" nonce_s nonce_c role)
    mac_s = HMAC-SHA256(secret, b"keras-ring store server" nonce_s nonce_c role)

The server closes the connection without a reply when mac_c is wrong; the
client trusts the server once mac_s checks out. Then requests, one reply each
(integers big-endian):

    b"S" key_len[2] key value            -> b"\\x00"
    b"G" timeout_ms[4] key_len[2] key    -> b"\\x00" value, or b"\\x01" if the key
                                            was not set within timeout_ms
    a request the server cannot serve    -> b"\\x02" message (UTF-8)

A malformed request drops the connection. Keys are 1 to `MAX_KEY_BYTES`
bytes and values at most `MAX_VALUE_BYTES`; a later set of a key replaces
its value. The handshake must finish within `handshake_timeout` seconds and
each later request come within `idle_timeout` seconds of the previous reply.

The process that serves the store reads and writes it directly, without a
connection (`get`, `set`, `keys`, `changes`, `wait_for_change`): the elastic
driver (`_elastic_driver.py`) decides from what the workers write and
answers them so.

Example:

    import secrets
    server = RendezvousServer(secrets.token_bytes(32))
    server.start()
    host, port = server.address  # given to the ranks with the secret
    ...
    server.stop()
"""

import hashlib
import hmac
import os
import secrets
import socket
import struct
import sys
import threading
import time

MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 1 << 20
MAX_FRAME_BYTES = MAX_VALUE_BYTES + MAX_KEY_BYTES + 16
MAX_ROLE_BYTES = 256

_MAGIC = b"KRS1"
_NONCE_BYTES = 32
_MAC_BYTES = 32
_OK, _NOT_SET, _ERROR = b"\x00", b"\x01", b"\x02"


class _Refused(Exception):
    """A connection broke the protocol; the message says how."""


def _format_address(address):
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _mac(secret, label, nonce_s, nonce_c, role):
    return hmac.new(secret, label + nonce_s + nonce_c + role, hashlib.sha256).digest()


def _recv_exact(conn, size, deadline, what):
    """`size` bytes, or None if the connection closed before the first."""
    data = bytearray()
    while len(data) < size:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            chunk = conn.recv(size - len(data))
        except TimeoutError:
            raise _Refused(f"it sent nothing for too long while sending {what}") from None
        if not chunk:
            if not data:
                return None
            raise _Refused(f"it closed the connection in the middle of {what}")
        data += chunk
    return bytes(data)


def _recv_frame(conn, deadline, what):
    """A frame's payload, or None if the connection closed between frames."""
    header = _recv_exact(conn, 4, deadline, what)
    if header is None:
        return None
    (size,) = struct.unpack("!I", header)
    if size > MAX_FRAME_BYTES:
        raise _Refused(f"it announced a frame of {size} bytes; at most {MAX_FRAME_BYTES} "
                       "are allowed")
    payload = _recv_exact(conn, size, deadline, what) if size else b""
    if payload is None:
        raise _Refused(f"it closed the connection in the middle of {what}")
    return payload


def _send_frame(conn, payload, timeout):
    conn.settimeout(timeout)
    conn.sendall(struct.pack("!I", len(payload)) + payload)


class RendezvousServer:
    """A job's key-value rendezvous store, served on a thread.

    Args:
        secret: The job's secret (bytes, not empty); every client proves it
            holds it, and so does the server.
        host: The address to listen on; one that every rank can reach.
        port: The port; 0 picks a free one (see `address`).
        handshake_timeout: Seconds a connection may take to authenticate.
        idle_timeout: Seconds an authenticated connection may stay silent.
        max_connections: Connections served at once; more are refused.
        max_store_bytes: The most the stored keys and values may take.

    Raises:
        TypeError: If `secret` is not bytes.
        ValueError: If `secret` is empty or a bound is not positive.

    Example:

        with RendezvousServer(secrets.token_bytes(32)) as server:
            host, port = server.address
    """

    def __init__(self, secret, host="127.0.0.1", port=0, *, handshake_timeout=10.0,
                 idle_timeout=600.0, max_connections=4096, max_store_bytes=256 << 20):
        if not isinstance(secret, bytes):
            raise TypeError("secret must be bytes. "
                            f"Received: secret of type {type(secret).__name__}")
        if not secret:
            raise ValueError("secret must not be empty. Received: secret=b''")
        for name, value in (("handshake_timeout", handshake_timeout),
                            ("idle_timeout", idle_timeout),
                            ("max_connections", max_connections),
                            ("max_store_bytes", max_store_bytes)):
            if not value > 0:
                raise ValueError(f"{name} must be positive. Received: {name}={value!r}")
        self._secret = secret
        self._host = host
        self._port = port
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._max_store_bytes = max_store_bytes
        self._listener = None
        self._accept_thread = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._values = {}  # guarded by _lock, as is everything below
        self._stored_bytes = 0
        self._changes = 0  # sets so far, from clients and from this process
        self._connections = {}  # socket -> its thread
        self._stopping = False

    @property
    def address(self):
        """(host, port) the server listens on, once started."""
        if self._listener is None:
            raise RuntimeError("the rendezvous server is not started")
        return self._listener.getsockname()[:2]

    def start(self):
        """Starts listening and serving on a thread."""
        if self._listener is not None:
            raise RuntimeError("the rendezvous server is started already")
        self._stopping = False
        family = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((self._host, self._port), family=family)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="keras-ring-rendezvous", daemon=True)
        self._accept_thread.start()

    def stop(self):
        """Stops serving, closes every connection and waits for the threads."""
        if self._listener is None:
            return
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
            connections = list(self._connections.items())
        # shutdown() wakes the threads blocked in accept() and recv().
        for sock in [self._listener] + [c for c, _ in connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join()
        for _, thread in connections:
            thread.join()
        self._listener.close()
        self._listener = None

    # In-process access for the launcher that serves the store. Keys are text (UTF-8), values
    # bytes.

    def get(self, key):
        """The value of `key`, read in this process without waiting.

        Args:
            key: The key (str).

        Returns:
            The value (bytes), or None if `key` is not set.
        """
        with self._lock:
            return self._values.get(key.encode())

    def set(self, key, value):
        """Sets `key` to `value`, as a client's set does, waking the gets that wait for it.

        Args:
            key: The key (str, 1 to `MAX_KEY_BYTES` bytes in UTF-8).
            value: The value (bytes, at most `MAX_VALUE_BYTES`).

        Raises:
            TypeError: If `value` is not bytes.
            ValueError: If the key or the value is too long or empty, or the
                store is full.
        """
        if not isinstance(value, bytes):
            raise TypeError(f"value must be bytes. Received: value of type "
                            f"{type(value).__name__}")
        encoded = key.encode()
        if not 0 < len(encoded) <= MAX_KEY_BYTES:
            raise ValueError(f"a key must have 1 to {MAX_KEY_BYTES} bytes. "
                             f"Received: a key of {len(encoded)} bytes")
        refusal = self._store(encoded, value)
        if refusal is not None:
            raise ValueError(f"cannot set {key!r}: {refusal}")

    def keys(self, prefix=""):
        """The keys set so far that start with `prefix`, sorted.

        Args:
            prefix: What the keys start with (str); all keys by default.

        Returns:
            A list of str (keys that are not UTF-8 are left out).
        """
        start = prefix.encode()
        with self._lock:
            found = [k for k in self._values if k.startswith(start)]
        keys = []
        for key in sorted(found):
            try:
                keys.append(key.decode())
            except UnicodeDecodeError:
                continue
        return keys

    @property
    def changes(self):
        """How many sets the store has had so far (from clients and `set`)."""
        with self._lock:
            return self._changes

    def wait_for_change(self, seen, timeout):
        """Waits until the store has had more than `seen` sets, at most `timeout` seconds.

        Args:
            seen: A value of `changes` read earlier.
            timeout: The most seconds to wait (0: do not wait).

        Returns:
            `changes` now: more than `seen` if a set came in time (or had
            come already), `seen` otherwise. It returns early, unchanged,
            once the server is stopping.
        """
        with self._lock:
            self._changed.wait_for(lambda: self._changes != seen or self._stopping,
                                   timeout=max(timeout, 0))
            return self._changes

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()

    def _accept_loop(self):
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # stop() shut the listener down
            peer = _format_address(peer)
            with self._lock:
                refuse = self._stopping or len(self._connections) >= self._max_connections
                if not refuse:
                    thread = threading.Thread(target=self._serve, args=(conn, peer), daemon=True)
                    self._connections[conn] = thread
            if refuse:
                if not self._stopping:
                    self._log(f"refused a connection from {peer}: it is one more than the "
                              f"{self._max_connections} served at once")
                conn.close()
                continue
            thread.start()

    def _log(self, message):
        print(f"keras-ring rendezvous: {message}", file=sys.stderr, flush=True)

    def _serve(self, conn, peer):
        try:
            with conn:
                try:
                    role = self._authenticate(conn)
                except _Refused as e:
                    self._log(f"refused a connection from {peer}: {e}")
                    return
                except OSError as e:
                    self._log(f"refused a connection from {peer}: {e.strerror or e}")
                    return
                try:
                    self._serve_requests(conn, role)
                except _Refused as e:
                    self._log(f"dropped the connection of {role} from {peer}: {e}")
                except OSError:
                    pass  # the client went away; a rank's own error says why
        finally:
            with self._lock:
                self._connections.pop(conn, None)

    def _authenticate(self, conn):
        deadline = time.monotonic() + self._handshake_timeout
        nonce_s = secrets.token_bytes(_NONCE_BYTES)
        _send_frame(conn, _MAGIC + nonce_s, self._handshake_timeout)
        answer = _recv_frame(conn, deadline, "the handshake")
        head = len(_MAGIC) + _NONCE_BYTES + _MAC_BYTES
        if answer is None:
            raise _Refused("it closed the connection before the handshake")
        if not answer.startswith(_MAGIC) or not head < len(answer) <= head + MAX_ROLE_BYTES:
            raise _Refused("it did not answer with a keras-ring handshake")
        nonce_c = answer[len(_MAGIC):len(_MAGIC) + _NONCE_BYTES]
        role = answer[head:]
        expected = _mac(self._secret, b"keras-ring store client", nonce_s, nonce_c, role)
        if not hmac.compare_digest(answer[head - _MAC_BYTES:head], expected):
            raise _Refused("it does not hold the job's secret")
        proof = _mac(self._secret, b"keras-ring store server", nonce_s, nonce_c, role)
        _send_frame(conn, proof, self._handshake_timeout)
        return role.decode("utf-8", "replace")

    def _serve_requests(self, conn, role):
        while True:
            request = _recv_frame(conn, time.monotonic() + self._idle_timeout, "a request")
            if request is None:
                return
            _send_frame(conn, self._reply(request), self._idle_timeout)

    def _reply(self, request):
        op = request[:1]
        if op == b"S" and len(request) >= 3:
            (key_size,) = struct.unpack("!H", request[1:3])
            key, value = request[3:3 + key_size], request[3 + key_size:]
            self._check_key(key, key_size)
            refusal = self._store(key, value)
            return _OK if refusal is None else _ERROR + refusal.encode()
        if op == b"G" and len(request) >= 7:
            timeout_ms, key_size = struct.unpack("!IH", request[1:7])
            key = request[7:]
            self._check_key(key, key_size)
            with self._lock:
                self._changed.wait_for(lambda: key in self._values or self._stopping,
                                       timeout=timeout_ms / 1000)
                value = self._values.get(key)
            return _NOT_SET if value is None else _OK + value
        raise _Refused(f"it sent a malformed request of {len(request)} bytes")

    def _store(self, key, value):
        """Sets `key` to `value`; returns why it cannot (a message), or None once set."""
        if len(value) > MAX_VALUE_BYTES:
            return f"a value of {len(value)} bytes; at most {MAX_VALUE_BYTES} are allowed"
        with self._lock:
            old = self._values.get(key)
            grown = len(key) + len(value) - (0 if old is None else len(key) + len(old))
            if self._stored_bytes + grown > self._max_store_bytes:
                return f"the store is full: it holds at most {self._max_store_bytes} bytes"
            self._values[key] = value
            self._stored_bytes += grown
            self._changes += 1
            self._changed.notify_all()
        return None

    @staticmethod
    def _check_key(key, key_size):
        if len(key) != key_size or not 0 < key_size <= MAX_KEY_BYTES:
            raise _Refused(f"it sent a malformed key ({len(key)} bytes where it announced "
                           f"{key_size}, at most {MAX_KEY_BYTES})")


class RendezvousClient:
    """A connection to a job's `RendezvousServer`, for Python code in the ranks.

    The engine has its own client (`TcpStoreClient`); this one serves the
    elastic layer, which asks the driver for each world through the store.

    Args:
        address: The server's "host:port" (`KERAS_RING_RENDEZVOUS`).
        secret: The job's secret, as bytes.
        role: Who connects, for the server's messages (1-256 bytes of UTF-8).
        timeout: Seconds to connect and authenticate, and to wait for each
            reply beyond a `get`'s own wait.

    Raises:
        ConnectionError: If the server cannot be reached, or it does not
            hold the job's secret, within `timeout`.

    Example:

        with RendezvousClient("127.0.0.1:4242", secret, "worker a:0:1") as store:
            store.set("key", b"value")
            value = store.get("key", timeout=10)
    """

    def __init__(self, address, secret, role, timeout=30.0):
        self._address = address
        self._timeout = timeout
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        deadline = time.monotonic() + timeout
        try:
            self._conn = socket.create_connection((host, int(port)), timeout=timeout)
        except (OSError, ValueError) as e:
            raise ConnectionError(f"keras-ring: cannot reach the rendezvous server at "
                                  f"{address}: {e}") from None
        try:
            self._authenticate(secret, role.encode("utf-8"), deadline)
        except BaseException:
            self._conn.close()
            raise

    def _authenticate(self, secret, role, deadline):
        try:
            hello = _recv_frame(self._conn, deadline, "the handshake")
            if hello is None or len(hello) != len(_MAGIC) + _NONCE_BYTES or \
                    not hello.startswith(_MAGIC):
                raise _Refused("it did not greet with a keras-ring handshake")
            nonce_s = hello[len(_MAGIC):]
            nonce_c = secrets.token_bytes(_NONCE_BYTES)
            mac_c = _mac(secret, b"keras-ring store client", nonce_s, nonce_c, role)
            _send_frame(self._conn, _MAGIC + nonce_c + mac_c + role, self._timeout)
            proof = _recv_frame(self._conn, deadline, "the handshake")
        except (_Refused, OSError) as e:
            raise ConnectionError(f"keras-ring: the handshake with the rendezvous server at "
                                  f"{self._address} failed: {e}") from None
        expected = _mac(secret, b"keras-ring store server", nonce_s, nonce_c, role)
        if proof is None or not hmac.compare_digest(proof, expected):
            raise ConnectionError(f"keras-ring: the rendezvous server at {self._address} "
                                  "does not hold the job's secret (or refused this one)")

    def set(self, key, value):
        """Sets `key` (str) to `value` (bytes)."""
        key = key.encode("utf-8")
        self._request(b"S" + struct.pack("!H", len(key)) + key + value, self._timeout,
                      f"setting {key!r}")

    def get(self, key, timeout):
        """The value of `key`, waiting up to `timeout` seconds for it to be set; None if not."""
        key = key.encode("utf-8")
        timeout_ms = max(0, int(timeout * 1000))
        reply = self._request(b"G" + struct.pack("!IH", timeout_ms, len(key)) + key,
                              timeout + self._timeout, f"getting {key!r}")
        return reply[1:] if reply[:1] == _OK else None

    def _request(self, request, timeout, what):
        try:
            _send_frame(self._conn, request, self._timeout)
            reply = _recv_frame(self._conn, time.monotonic() + timeout, what)
        except (_Refused, OSError) as e:
            raise ConnectionError(f"keras-ring: the rendezvous server at {self._address} did "
                                  f"not answer {what}: {e}") from None
        if reply is None:
            raise ConnectionError(f"keras-ring: the rendezvous server at {self._address} "
                                  f"closed the connection while {what}")
        if reply[:1] == _ERROR:
            raise ConnectionError(f"keras-ring: the rendezvous server at {self._address} "
                                  f"refused {what}: {reply[1:].decode('utf-8', 'replace')}")
        if reply[:1] not in (_OK, _NOT_SET):
            raise ConnectionError(f"keras-ring: the rendezvous server at {self._address} "
                                  f"answered {what} with a malformed reply")
        return reply

    def close(self):
        """Closes the connection."""
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _serve_until_stdin_closes():
    """Serves one job until stdin closes: the engine's C++ tests meet the real
    server this way. The secret comes hex-encoded in KERAS_RING_SECRET; the
    address is printed as one line, host:port."""
    secret = bytes.fromhex(os.environ["KERAS_RING_SECRET"])
    with RendezvousServer(secret) as server:
        print(_format_address(server.address), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    _serve_until_stdin_closes()
