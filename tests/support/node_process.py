"""Runs a storage node as its own process for crash tests: prints its port, serves until killed."""

import sys
import time

from waltz.storage import Storage, StorageNode

storage = Storage.open(sys.argv[1])
node = StorageNode.start(storage)
print(node.address[1], flush=True)
while True:
    time.sleep(3600)
