#!/bin/sh
# in_node.sh NETNS NAME CMD...: run CMD as if on node NAME of a namespaced local cluster: in
# network namespace NETNS (/run/netns/NETNS, made by `ip netns add`), with host name NAME and,
# if /etc/netns/NETNS/hosts exists, that file as /etc/hosts (new UTS and mount namespaces, so
# nothing leaks). Unlike `ip netns exec`, /sys stays the machine's: slurmd needs its cgroup mounts.
set -e
if [ -z "${IN_NODE_ENTERED:-}" ]; then
  IN_NODE_ENTERED=1 exec nsenter --net="/run/netns/$1" unshare --mount --uts "$0" "$@"
fi
unset IN_NODE_ENTERED
ns="$1" name="$2"
shift 2
if [ -f "/etc/netns/$ns/hosts" ]; then mount --bind "/etc/netns/$ns/hosts" /etc/hosts; fi
hostname "$name"
exec "$@"
