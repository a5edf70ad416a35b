"""Profile one-block pulls: py-spy on both sidecars while this process pulls in a loop.

Two real sidecars on loopback, engines played by this process through the thin
client (as bench/latency.py). While `--seconds` of back-to-back one-block pulls
run (other sidecar, or the same sidecar with --local), py-spy samples both
sidecar processes and writes speedscope/flamegraph files.

    .venv/bin/pip install py-spy
    python bench/profile_pull.py --out /tmp/prof                # other sidecar (host-nixl)
    python bench/profile_pull.py --out /tmp/prof --local        # same sidecar (host-direct)
    python bench/profile_pull.py --out /tmp/prof --idle --format speedscope   # wall clock, idle threads too
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import pull_once, register
from report import quantile

from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the profiles")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--local", action="store_true", help="same sidecar (host-direct)")
    ap.add_argument("--idle", action="store_true", help="py-spy --idle: sample waiting threads too")
    ap.add_argument("--native", action="store_true", help="py-spy --native")
    ap.add_argument("--format", default="flamegraph", choices=["flamegraph", "speedscope", "raw"])
    ap.add_argument("--rate", type=int, default=1000, help="samples per second")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    a, b = (
        SidecarProcess("prof-prefill", start_timeout_s=120),
        SidecarProcess("prof-decode", start_timeout_s=120),
    )
    caches = []
    try:
        ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
        caches += [register(ca, "prof-p"), register(cb if not args.local else ca, "prof-d")]
        dec = ca if args.local else cb
        for _ in range(20):  # warm up: handshake, descriptor lists, connections
            pull_once(ca, "prof-p", dec, "prof-d")
        ext = {"flamegraph": "svg", "speedscope": "json", "raw": "txt"}[args.format]
        tag = "local" if args.local else "remote"
        spies = []
        for name, sc in (("prefill", a), ("decode", b)):
            cmd = [
                pyspy, "record", "--pid", str(sc.proc.pid), "--duration", str(int(args.seconds)),
                "--rate", str(args.rate), "--threads", "--format", args.format,
                "-o", str(out / f"{tag}-{name}.{ext}"),
            ]  # fmt: skip
            cmd += ["--idle"] if args.idle else []
            cmd += ["--native"] if args.native else []
            spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        time.sleep(1.0)  # let py-spy attach
        samples = []
        end = time.monotonic() + args.seconds - 2
        while time.monotonic() < end:
            samples.append(pull_once(ca, "prof-p", dec, "prof-d"))
        for s in spies:
            _, err = s.communicate(timeout=120)
            if s.returncode:
                print(err, file=sys.stderr)
        print(
            f"{tag}: {len(samples)} pulls, p50 {statistics.median(samples) * 1e3:.3f} ms, "
            f"p99 {quantile(samples, 0.99) * 1e3:.3f} ms; profiles in {out} "
            f"(prefill pid {a.proc.pid}, decode pid {b.proc.pid}, load {os.getloadavg()[0]:.1f})"
        )
    finally:
        for c in caches:
            c.close()
        a.stop()
        b.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
