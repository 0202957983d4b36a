#!/bin/sh
# Creates the cluster and gives it its storage nodes: the one-shot init of compose.yaml and of
# kubernetes/init-job.yaml (installed in the image as waltz-init-cluster), and what to run once by
# hand beside the systemd units (docs/operations.md, "Deploying"). Idempotent: a rerun, or a job
# restarted half-way, finishes the work and changes nothing that is done.
#
#   WALTZ_METADATA, WALTZ_CLUSTER      the metadata store and the cluster name, as for every `waltz` command
#   WALTZ_CLUSTER_KEY                  the UUID the storage nodes are configured with
#   WALTZ_PARTITIONS, WALTZ_REPLICAS   the cluster's shape
#   WALTZ_STORAGE_NODES                "host:port host:port ...", the storage nodes' addresses;
#                                      node i goes into storage group i mod WALTZ_REPLICAS
#   WALTZ_STORAGE_ADMIN_PORT           their admin port (default 55281)
set -eu
: "${WALTZ_METADATA:?}" "${WALTZ_CLUSTER_KEY:?}" "${WALTZ_PARTITIONS:?}" "${WALTZ_REPLICAS:?}" "${WALTZ_STORAGE_NODES:?}"

# --key comes from WALTZ_CLUSTER_KEY: a cluster that exists with another key is an error.
waltz cluster create --partitions "$WALTZ_PARTITIONS" --replicas "$WALTZ_REPLICAS"

i=0
for node in $WALTZ_STORAGE_NODES; do
  waltz storage add-node --storage "$node" --admin-port "${WALTZ_STORAGE_ADMIN_PORT:-55281}" --group $((i % WALTZ_REPLICAS))
  i=$((i + 1))
done
# One replica of every partition per group, on the group's least loaded node.
group=0
while [ "$group" -lt "$WALTZ_REPLICAS" ] && [ "$group" -lt "$i" ]; do
  waltz storage auto-assign --group "$group"
  group=$((group + 1))
done

# Create each node's files for the partitions assigned to it.
waltz --json storage list | python3 -c '
import json, sys
for node in json.load(sys.stdin):
    print(node["address"], *node["partitions"])
' | while read -r address partitions; do
  [ -n "$partitions" ] || continue
  set --
  for p in $partitions; do set -- "$@" -p "$p"; done
  waltz storage add-partition --storage "$address" "$@"
done
waltz storage list --status
