"""Runs a benchmark across two hosts made of network namespaces (tests/netns_hosts.py).

    sudo .venv/bin/python benchmarks/across_netns_hosts.py [--slots 1] -- \\
        benchmarks/allreduce_vs_mpi4py.py --transport mpi tcp --sizes-mib 16 32 64

makes two hosts joined by veth pairs and a bridge (10.77.0.1 and 10.77.0.2,
reaching nothing else), measures raw TCP between them in both directions at
once (benchmarks/_tcp_link.py; `--link-mib 0` skips it), then runs
`keras-ring-run -np 2*SLOTS -H host0:SLOTS,host1:SLOTS --remote-shell
tests/netns_rsh.sh python SCRIPT ARGS --store-host 10.77.0.1` from inside host0,
with the environment the multi-host tests use (MPICH's data over TCP on the
veths: UCX_TLS=self,tcp), and deletes the hosts afterwards. Needs root.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns_hosts import NetnsHosts  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=1, help="ranks per host")
    parser.add_argument("--link-mib", type=float, default=256,
                        help="first measure raw TCP between the hosts with this much (0: not)")
    parser.add_argument("script", help="the benchmark script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args()
    why = NetnsHosts.unavailable()
    if why:
        raise SystemExit(why)
    hosts = NetnsHosts(2).create()
    try:
        if args.link_mib:
            link = [sys.executable, str(Path(__file__).with_name("_tcp_link.py"))]
            server = subprocess.Popen([*hosts.exec_prefix(0), *link, "serve", hosts.addresses[0],
                                       str(args.link_mib)])
            subprocess.run([*hosts.exec_prefix(1), *link, "connect", hosts.addresses[0],
                            str(args.link_mib)], check=True, timeout=300)
            server.wait(timeout=60)
        bin_dir = os.path.dirname(sys.executable)
        command = [*hosts.exec_prefix(0), os.path.join(bin_dir, "keras-ring-run"),
                   "-np", str(2 * args.slots),
                   "-H", ",".join(f"{h}:{args.slots}" for h in hosts.hosts), "--",
                   sys.executable, os.path.abspath(args.script), *args.args,
                   "--store-host", hosts.addresses[0]]
        env = {**os.environ, **hosts.env(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        code = subprocess.run(command, env=env).returncode
        print(f"bytes through the bridge ports of host0, host1: {hosts.port_bytes()}")
    finally:
        hosts.destroy()
    sys.exit(code)


if __name__ == "__main__":
    main()
