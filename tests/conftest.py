"""The suite's sidecars and reference engines start from one fork server per test process, which has
imported their modules once (refengine/forkserver.py): ~2 s of CPU less for each of the hundreds of
processes the suite starts. KV_SIDECAR_TEST_FORK_SERVER=0 starts each from scratch instead."""

import os

from kv_sidecar.refengine import procs

if os.environ.get("KV_SIDECAR_TEST_FORK_SERVER", "1") != "0":
    procs.use_fork_server()
