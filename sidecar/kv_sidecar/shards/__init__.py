"""Control shards (`control_shards`): one node sidecar run as several sidecar processes behind a front
door, so that its control work is not bound to one interpreter (docs/architecture.md, "Control shards").

placement.py decides which shard serves a rank (pure); children.py starts, watches and restarts the
shard processes; front_door.py serves the engine socket (Route, Status), health and merged metrics;
run.py is `kv-sidecar serve` when control_shards > 1. Nothing here imports the server or the data
plane: a shard is a whole sidecar, run as a process.
"""
