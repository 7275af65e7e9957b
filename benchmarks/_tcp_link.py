"""Raw TCP between two hosts, both ways at once: what a 2-rank allreduce's link allows.

    python benchmarks/_tcp_link.py serve|connect ADDRESS MIB

The side that serves listens on ADDRESS:5601, the other connects; each then
sends MIB MiB and receives as many at the same time (a 2-rank ring allreduce
of MIB MiB moves that much each way), and prints GB/s each way.
"""

import socket
import sys
import threading
import time

PORT = 5601
CHUNK = 1 << 20


def main():
    role, address, mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
    nbytes = int(mib * 2**20)
    if role == "serve":
        with socket.create_server((address, PORT)) as listener:
            conn, _ = listener.accept()
    else:
        for _ in range(100):
            try:
                conn = socket.create_connection((address, PORT))
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"cannot connect to {address}:{PORT}")
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(b"x")
    conn.recv(1)

    def send():
        data = memoryview(bytearray(CHUNK))
        left = nbytes
        while left > 0:
            left -= conn.send(data[:min(left, CHUNK)])

    buf = bytearray(CHUNK)
    start = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    got = 0
    while got < nbytes:
        n = conn.recv_into(buf)
        if n == 0:
            raise SystemExit("the peer closed the connection")
        got += n
    sender.join()
    seconds = time.perf_counter() - start
    conn.close()
    print(f"raw TCP {role}: {mib:g} MiB each way, both at once: {nbytes / seconds / 1e9:.2f} GB/s "
          "each way", flush=True)


if __name__ == "__main__":
    main()
