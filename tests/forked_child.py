"""A module the fork server's test (tests/test_forkserver.py) runs as `python -m tests.forked_child`: it
says what it was given, echoes one stdin line, and exits with the code its first argument names."""

import json
import os
import sys

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "env": os.environ.get("FORKED_CHILD_VALUE"),
                "cwd": os.getcwd(),
                "pid": os.getpid(),
                "main": __name__,
            }
        ),
        flush=True,
    )
    print("to stderr", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    print(line.strip().upper(), flush=True)
    raise SystemExit(int(sys.argv[1]))
