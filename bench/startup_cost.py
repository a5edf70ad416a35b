"""Where a process's start-up time goes on this machine: the interpreter, torch, CUDA, a NIXL agent with
UCX, the sidecar's imports and a whole `kv-sidecar serve` until it is ready. Each step runs in a fresh
process, three times; the table gives the median wall clock.

Why: the CPU suite's cost is dominated by sidecar start-up, which on a GPU machine took ~7x longer
than on a CPU-only one. This shows which step pays for it (run it with and without CUDA_VISIBLE_DEVICES="").

    python bench/startup_cost.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

STEPS: dict[str, str] = {
    "interpreter": "pass",
    "import torch": "import torch",
    "torch.cuda.is_available()": "import torch; torch.cuda.is_available()",
    "import nixl": "from kv_sidecar.transport.nixl_driver import import_nixl; import_nixl()",
    "NIXL agent (UCX)": (
        "from kv_sidecar.transport.nixl_driver import import_nixl; api = import_nixl(); "
        "api.nixl_agent('probe', api.nixl_agent_config(enable_prog_thread=False, backends=['UCX']))"
    ),
    "import kv_sidecar.server.sidecar": "import kv_sidecar.server.sidecar",
    "sidecar ready (kv-sidecar serve)": (
        "from kv_sidecar.refengine.procs import SidecarProcess; s = SidecarProcess(); s.stop()"
    ),
}


def timed(code: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(root, "sidecar"), os.path.join(root, "client"), base.get("PYTHONPATH", "")]
    )
    variants = {"as is": base, 'CUDA_VISIBLE_DEVICES=""': {**base, "CUDA_VISIBLE_DEVICES": ""}}
    print(f"| step | {' | '.join(variants)} |")
    print(f"|---|{'---:|' * len(variants)}")
    for name, code in STEPS.items():
        cells = []
        for env in variants.values():
            try:
                cells.append(f"{statistics.median(timed(code, env) for _ in range(3)):.2f} s")
            except subprocess.CalledProcessError as e:
                cells.append(f"failed ({e.stderr.decode(errors='replace').strip().splitlines()[-1][:60]})")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
