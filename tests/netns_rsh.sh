#!/bin/sh
# The remote shell of the network-namespace hosts of tests/netns_hosts.py, called as Hydra calls
# ssh (`mpiexec -launcher ssh -launcher-exec tests/netns_rsh.sh`):
#
#     netns_rsh.sh [SSH OPTIONS] HOST COMMAND...
#
# runs COMMAND, one shell command line as ssh runs it (Hydra quotes its words for a remote shell),
# inside HOST's network namespace, as if logged in to HOST:
#   - its network namespace (`ip netns exec`): its own loopback and 10.77.0.x address;
#   - its own host name (a UTS namespace; `ip netns exec` leaves the machine's), and
#     KERAS_RING_HOSTNAME=HOST, so that the engine groups ranks by HOST (unless
#     KR_NETNS_SET_HOSTNAME=0: then it groups them by the host name alone);
#   - its own /dev/shm: $KR_NETNS_SHM/HOST bind-mounted over /dev/shm in the mount namespace
#     `ip netns exec` makes (which otherwise shares the machine's /dev/shm).
# The environment is this one's (Hydra's own), as ssh with a shared home and `SendEnv` would
# give; Hydra sends the ranks' environment to its proxy itself.
#
# KR_NETNS_HOSTS maps host names to namespaces: "host0=NAMESPACE0 host1=NAMESPACE1 ...".
# Errors of this script exit with 255, as ssh's do; otherwise COMMAND's exit status.
set -eu

while [ $# -gt 0 ]; do
    case $1 in
        -[BbcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take a value
        --) shift; break ;;
        -*) shift ;;  # -x (no X forwarding, Hydra's), -q, -T, ...
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "usage: $0 [ssh options] HOST COMMAND..." >&2
    exit 255
fi
host=$1
shift
namespace=
for entry in ${KR_NETNS_HOSTS:-}; do
    case $entry in
        "$host="*) namespace=${entry#*=} ;;
    esac
done
if [ -z "$namespace" ]; then
    echo "$0: $host: no such host (KR_NETNS_HOSTS=${KR_NETNS_HOSTS:-})" >&2
    exit 255
fi
if [ "${KR_NETNS_SET_HOSTNAME:-1}" = 1 ]; then
    export KERAS_RING_HOSTNAME="$host"
fi
# shellcheck disable=SC2016  # expanded by the inner shell
exec ip netns exec "$namespace" unshare --uts /bin/sh -c '
    hostname "$1" && mount --bind "$2" /dev/shm || exit 255
    shift 2
    exec /bin/sh -c "$*"' netns_rsh "$host" "${KR_NETNS_SHM:?}/$host" "$@"
