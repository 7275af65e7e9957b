"""The rendezvous server through which the ranks of a TCP world find each other.

The launcher runs one `RendezvousServer` per job: a key-value store on
threads, where each rank sets its listening address and gets the others'
(the C++ client is `TcpStoreClient`, custom_ops/core/transport/tcp/store.h).
Every connection must prove it holds the job's secret before anything is
served; one that does not, or that sends garbage or oversized frames, is
refused, and the job goes on. Until it has logged in, a connection costs the
server a socket and a few hundred bytes, not a thread: the logins are served
together on one thread, each bounded in time (`handshake_timeout`) and in size
(`MAX_LOGIN_FRAME_BYTES`), and so is their number, in all and per source
address, by dropping the oldest. The first refusal is one line on stderr
naming its address and reason; those that follow within `log_interval` are
counted, by reason and address, on one line an interval.

Wire protocol. Every message is a frame: a 4-byte big-endian payload length,
then the payload, at most `MAX_FRAME_BYTES`; a connection that announces a
longer frame is dropped (before login, one longer than
`MAX_LOGIN_FRAME_BYTES`). A connection first authenticates:

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

import collections
import errno
import hashlib
import hmac
import os
import secrets
import selectors
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
# The client's handshake frame, the only one a connection may send before it logs in.
MAX_LOGIN_FRAME_BYTES = len(_MAGIC) + _NONCE_BYTES + _MAC_BYTES + MAX_ROLE_BYTES
_OK, _NOT_SET, _ERROR = b"\x00", b"\x01", b"\x02"


class _Refused(Exception):
    """A connection broke the protocol: `message` says how, `kind` in a few words (for counts)."""

    def __init__(self, message, kind="broke the protocol"):
        super().__init__(message)
        self.message = message
        self.kind = kind


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


class _Login:
    """A connection that has not yet proved it holds the secret, served without a thread.

    The server sends its greeting (`unsent` holds what is left of it) and reads the client's
    one handshake frame as it comes, up to `MAX_LOGIN_FRAME_BYTES`, until `deadline`.
    """

    def __init__(self, sock, peer, deadline, nonce_s):
        self.sock = sock
        self.peer = peer  # (host, port)
        self.deadline = deadline
        self.nonce_s = nonce_s
        self.unsent = struct.pack("!I", len(_MAGIC) + _NONCE_BYTES) + _MAGIC + nonce_s
        self.received = bytearray()

    def advance(self, events):
        """Sends and reads what the socket allows; returns the handshake frame once complete.

        Raises:
            _Refused: If the peer closed the connection or announced a frame too long.
            OSError: If the connection broke.
        """
        if self.unsent and events & selectors.EVENT_WRITE:
            self.unsent = self.unsent[self.sock.send(self.unsent):]
        if not events & selectors.EVENT_READ:
            return None
        chunk = self.sock.recv(self._wanted())
        if not chunk:
            raise _Refused("it closed the connection in the middle of the handshake"
                           if self.received else
                           "it closed the connection before the handshake", "closed early")
        self.received += chunk
        if self._wanted() or self.unsent:
            return None
        return bytes(self.received[4:])

    def _wanted(self):
        """How many more bytes the handshake frame needs."""
        if len(self.received) < 4:
            return 4 - len(self.received)
        (size,) = struct.unpack("!I", self.received[:4])
        if size > MAX_LOGIN_FRAME_BYTES:
            raise _Refused(f"it announced a handshake frame of {size} bytes; a handshake has "
                           f"at most {MAX_LOGIN_FRAME_BYTES}", "not a handshake")
        return 4 + size - len(self.received)


class _Logins:
    """The connections logging in, oldest first, on one selector, with the bounds on them."""

    def __init__(self, selector, refusals, max_logins, max_per_address):
        self.refusals = refusals
        self._selector = selector
        self._max_logins = max_logins
        self._max_per_address = max_per_address
        self._logins = {}  # socket -> _Login, in the order they came
        self._per_address = collections.Counter()

    def __contains__(self, login):
        return self._logins.get(login.sock) is login

    def add(self, login):
        self._logins[login.sock] = login
        self._per_address[login.peer[0]] += 1
        self._selector.register(login.sock, selectors.EVENT_READ, login)

    def watch(self, login):
        """Waits for `login` to be readable, and writable while it has something to send."""
        self._selector.modify(login.sock, selectors.EVENT_READ | (
            selectors.EVENT_WRITE if login.unsent else 0), login)

    def remove(self, login):
        """Forgets `login`, leaving its socket open."""
        self._selector.unregister(login.sock)
        del self._logins[login.sock]
        self._per_address[login.peer[0]] -= 1
        if not self._per_address[login.peer[0]]:
            del self._per_address[login.peer[0]]

    def drop(self, login, refusal, now):
        """Logs why, then closes `login`'s connection (so the line is there once the
        client sees the close)."""
        self.remove(login)
        self.refusals.refuse(login.peer, refusal, now)
        login.sock.close()

    def make_room(self, host, now):
        """Drops the oldest login from `host`, or the oldest of all, where the next would
        pass a bound."""
        if host is not None and self._per_address[host] >= self._max_per_address:
            oldest = next(x for x in self._logins.values() if x.peer[0] == host)
            self.drop(oldest, _Refused(
                f"it was one of more than {self._max_per_address} connections logging in at "
                "once from its address", "dropped for a newer one from its address"), now)
        elif self._logins and (host is None or len(self._logins) >= self._max_logins):
            self.drop(next(iter(self._logins.values())), _Refused(
                f"it was one of more than {self._max_logins} connections logging in at once",
                "dropped for a newer one"), now)

    def next_deadline(self):
        """The next time `expire` or the refusal log has something to do, or None."""
        times = [self.refusals.next_flush()]
        if self._logins:
            times.append(next(iter(self._logins.values())).deadline)
        return min((t for t in times if t is not None), default=None)

    def expire(self, now, timeout):
        """Drops the logins past their deadline (the oldest come first)."""
        while self._logins and next(iter(self._logins.values())).deadline <= now:
            self.drop(next(iter(self._logins.values())), _Refused(
                f"it did not log in within {timeout:g} s", "did not log in in time"), now)

    def close(self):
        for login in self._logins.values():
            login.sock.close()
        self._logins.clear()
        self.refusals.flush(time.monotonic(), stopping=True)


class _RefusalLog:
    """Refused connections on stderr: the first one line in full, then, while they keep
    coming, one line each `interval` seconds that counts them by reason and address."""

    def __init__(self, interval):
        self._interval = interval
        self._quiet_until = 0.0
        self._since = 0.0
        self._reasons = collections.Counter()
        self._addresses = collections.Counter()

    def refuse(self, peer, refusal, now):
        if now >= self._quiet_until and not self._reasons:
            _log(f"refused a connection from {_format_address(peer)}: {refusal.message}")
            self._quiet_until = now + self._interval
            self._since = now
            return
        self._reasons[refusal.kind] += 1
        self._addresses[peer[0]] += 1

    def next_flush(self):
        """When `flush` has something to say, or None."""
        return self._quiet_until if self._reasons else None

    def flush(self, now, stopping=False):
        if not self._reasons or (now < self._quiet_until and not stopping):
            return
        count = sum(self._reasons.values())
        reasons = "; ".join(f"{n} {kind}" for kind, n in self._reasons.most_common())
        top = self._addresses.most_common(3)
        addresses = ", ".join(f"{host} ({n})" for host, n in top)
        if len(self._addresses) > len(top):
            addresses += f" and {len(self._addresses) - len(top)} more addresses"
        _log(f"refused {count} more connection{'s' if count > 1 else ''} in the last "
             f"{now - self._since:.1f} s ({reasons}), from {addresses}")
        self._reasons.clear()
        self._addresses.clear()
        self._quiet_until = now + self._interval
        self._since = now


def _log(message):
    print(f"keras-ring rendezvous: {message}", file=sys.stderr, flush=True)


class RendezvousServer:
    """A job's key-value rendezvous store, served on threads.

    Connections that have not logged in are served together on one thread,
    each with a deadline, a bounded handshake frame, and a bounded number of
    them at once, in all and per source address: past a bound, the oldest is
    dropped, so a flood of idle connections cannot keep a rank out. Each
    logged-in connection is served on a thread of its own.

    Args:
        secret: The job's secret (bytes, not empty); every client proves it
            holds it, and so does the server.
        host: The address to listen on; one that every rank can reach.
        port: The port; 0 picks a free one (see `address`).
        handshake_timeout: Seconds a connection may take to log in.
        idle_timeout: Seconds a logged-in connection may stay silent.
        max_connections: Logged-in connections served at once; more are refused.
        max_logins: Connections logging in at once.
        max_logins_per_address: Connections logging in at once from one address.
        max_store_bytes: The most the stored keys and values may take.
        log_interval: Seconds between the lines that count refused connections.

    Raises:
        TypeError: If `secret` is not bytes.
        ValueError: If `secret` is empty or a bound is not positive.

    Example:

        with RendezvousServer(secrets.token_bytes(32)) as server:
            host, port = server.address
    """

    def __init__(self, secret, host="127.0.0.1", port=0, *, handshake_timeout=10.0,
                 idle_timeout=600.0, max_connections=4096, max_logins=512,
                 max_logins_per_address=128, max_store_bytes=256 << 20, log_interval=10.0):
        if not isinstance(secret, bytes):
            raise TypeError("secret must be bytes. "
                            f"Received: secret of type {type(secret).__name__}")
        if not secret:
            raise ValueError("secret must not be empty. Received: secret=b''")
        for name, value in (("handshake_timeout", handshake_timeout),
                            ("idle_timeout", idle_timeout),
                            ("max_connections", max_connections),
                            ("max_logins", max_logins),
                            ("max_logins_per_address", max_logins_per_address),
                            ("max_store_bytes", max_store_bytes),
                            ("log_interval", log_interval)):
            if not value > 0:
                raise ValueError(f"{name} must be positive. Received: {name}={value!r}")
        self._secret = secret
        self._host = host
        self._port = port
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._max_logins = max_logins
        self._max_logins_per_address = max_logins_per_address
        self._max_store_bytes = max_store_bytes
        self._log_interval = log_interval
        self._listener = None
        self._login_thread = None
        self._wake = None  # (read, write) sockets that wake the login thread to stop
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._values = {}  # guarded by _lock, as is everything below
        self._stored_bytes = 0
        self._changes = 0  # sets so far, from clients and from this process
        self._connections = {}  # logged-in socket -> its thread
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
        self._listener = socket.create_server((self._host, self._port), family=family,
                                              backlog=1024)
        self._listener.setblocking(False)
        self._wake = socket.socketpair()
        self._login_thread = threading.Thread(
            target=self._login_loop, name="keras-ring-rendezvous", daemon=True)
        self._login_thread.start()

    def stop(self):
        """Stops serving, closes every connection and waits for the threads."""
        if self._listener is None:
            return
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
            connections = list(self._connections.items())
        self._wake[1].send(b"x")
        # shutdown() wakes the threads blocked in recv().
        for sock, _ in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._login_thread.join()
        for _, thread in connections:
            thread.join()
        self._listener.close()
        self._listener = None
        for sock in self._wake:
            sock.close()
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

    def _login_loop(self):
        selector = selectors.DefaultSelector()
        selector.register(self._wake[0], selectors.EVENT_READ)
        selector.register(self._listener, selectors.EVENT_READ)
        logins = _Logins(selector, _RefusalLog(self._log_interval), self._max_logins,
                         self._max_logins_per_address)
        resume_at = None  # when to listen again, after running out of file descriptors
        try:
            while not self._stopping:
                now = time.monotonic()
                if resume_at is not None and now >= resume_at:
                    selector.register(self._listener, selectors.EVENT_READ)
                    resume_at = None
                wake_at = [t for t in (logins.next_deadline(), resume_at) if t is not None]
                timeout = max(0.0, min(wake_at) - now) if wake_at else None
                for key, events in selector.select(timeout):
                    now = time.monotonic()
                    if key.fileobj is self._listener:
                        if not self._accept(logins, now):
                            selector.unregister(self._listener)
                            resume_at = now + 0.1
                    elif key.fileobj is not self._wake[0] and key.data in logins:
                        self._advance(logins, key.data, events, now)
                now = time.monotonic()
                logins.expire(now, self._handshake_timeout)
                logins.refusals.flush(now)
        finally:
            logins.close()
            selector.close()

    def _accept(self, logins, now):
        """Accepts what the listener has; returns False if it ran out of file descriptors."""
        for _ in range(64):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logins.make_room(None, now)  # the next connection takes an old one's place
                    return False
                continue  # ECONNABORTED and the like: that connection is gone
            sock.setblocking(False)
            logins.make_room(peer[0], now)
            login = _Login(sock, peer[:2], now + self._handshake_timeout,
                           secrets.token_bytes(_NONCE_BYTES))
            logins.add(login)
            self._advance(logins, login, selectors.EVENT_WRITE, now)
        return True

    def _advance(self, logins, login, events, now):
        """Sends and reads what `login`'s socket allows; admits it once its frame is in."""
        try:
            frame = login.advance(events)
        except _Refused as refusal:
            logins.drop(login, refusal, now)
            return
        except OSError as e:
            logins.drop(login, _Refused(e.strerror or str(e), "broken off"), now)
            return
        if frame is None:
            logins.watch(login)
            return
        logins.remove(login)
        self._admit(login, frame, logins.refusals, now)

    def _admit(self, login, frame, refusals, now):
        """Checks a complete handshake; serves its connection on a thread if it logs in."""
        try:
            role, proof = self._check_handshake(login.nonce_s, frame)
            with self._lock:
                if self._stopping:
                    login.sock.close()
                    return
                if len(self._connections) >= self._max_connections:
                    raise _Refused(f"it is one more than the {self._max_connections} served at "
                                   "once", "over the bound on connections")
                thread = threading.Thread(target=self._serve, daemon=True, args=(
                    login.sock, _format_address(login.peer), role, proof))
                self._connections[login.sock] = thread
        except _Refused as refusal:
            refusals.refuse(login.peer, refusal, now)
            login.sock.close()
            return
        thread.start()

    def _check_handshake(self, nonce_s, frame):
        """The client's role (text) and the server's proof, from its handshake frame.

        Raises:
            _Refused: If it is not a handshake, or its MAC is not of the job's secret.
        """
        head = len(_MAGIC) + _NONCE_BYTES + _MAC_BYTES
        if not frame.startswith(_MAGIC) or not head < len(frame):
            raise _Refused("it did not answer with a keras-ring handshake", "not a handshake")
        nonce_c = frame[len(_MAGIC):len(_MAGIC) + _NONCE_BYTES]
        role = frame[head:]
        expected = _mac(self._secret, b"keras-ring store client", nonce_s, nonce_c, role)
        if not hmac.compare_digest(frame[head - _MAC_BYTES:head], expected):
            raise _Refused("it does not hold the job's secret", "without the secret")
        proof = _mac(self._secret, b"keras-ring store server", nonce_s, nonce_c, role)
        return role.decode("utf-8", "replace"), proof

    def _serve(self, conn, peer, role, proof):
        try:
            with conn:
                conn.setblocking(True)
                try:
                    _send_frame(conn, proof, self._handshake_timeout)
                    self._serve_requests(conn, role)
                except _Refused as e:
                    _log(f"dropped the connection of {role} from {peer}: {e.message}")
                except OSError:
                    pass  # the client went away; a rank's own error says why
        finally:
            with self._lock:
                self._connections.pop(conn, None)

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
