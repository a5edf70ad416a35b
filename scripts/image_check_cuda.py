"""Checks run inside the CUDA image, without a GPU (scripts/image_check_cuda.sh starts it).

1. `kv-sidecar --version` answers.
2. In a fresh process that has not imported torch (the case the Dockerfile's ldconfig step is for):
   `import nixl` picks the backend of torch's CUDA major, a NIXL agent with the UCX backend is created,
   and UCX's module loader loads its CUDA modules (libuct_cuda: the cuda_copy/cuda_ipc transports;
   libucm_cuda: CUDA memory hooks, which need libcudart.so.<major> through the loader cache). The NVIDIA
   driver is not in the image; the caller supplies a stub (LD_LIBRARY_PATH) that says "no device".
   With --expect-cuda-modules-missing the same must fail (the caller hides the loader cache): the
   check can see the silent loss it guards against.
3. torch is a CUDA build of that major.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

CUDA_MODULES = ("libuct_cuda", "libucm_cuda")

PROBE = r"""
import json, sys
import nixl
import nixl._api as api
backend = api.__name__.split(".")[0]  # the submodule nixl re-exports, e.g. nixl_cu13._api
torch_loaded = "torch" in sys.modules
agent = api.nixl_agent("image-check", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
print("PROBE", json.dumps({"backend": backend, "backends": list(agent.backends), "torch_loaded": torch_loaded}))
"""


def ucx_modules(log: str) -> dict[str, str]:
    """What UCX's module loader said about each CUDA module: 'loaded' or its dlopen error."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        for mod in CUDA_MODULES:
            if f"/{mod}.so" not in line:
                continue
            if re.search(r"DEBUG loaded \S*/" + mod + r"\.so", line):
                out[mod] = "loaded"
            elif m := re.search(r"dlopen\(.*/" + mod + r"\.so[^)]*\).* failed: (.*)$", line):
                out.setdefault(mod, m.group(1).strip())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda-major", required=True)
    ap.add_argument("--expect-cuda-modules-missing", action="store_true")
    args = ap.parse_args()
    failed = False

    def report(ok: bool, what: str) -> None:
        nonlocal failed
        failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'}  {what}", flush=True)

    env = {**os.environ, "UCX_LOG_LEVEL": "debug"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode:
        report(False, f"NIXL agent with UCX: exit {r.returncode}\n{r.stderr[-3000:]}")
        return 1
    # UCX writes its log to stdout: the probe's answer is the line that starts with PROBE.
    (answer,) = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    probe = json.loads(answer.removeprefix("PROBE "))
    mods = ucx_modules(r.stdout + r.stderr)
    if args.expect_cuda_modules_missing:
        report(
            mods.get("libucm_cuda", "") != "loaded",
            f"without the loader cache libucm_cuda is not loaded: {mods}",
        )
        return int(failed)

    v = subprocess.run(["kv-sidecar", "--version"], capture_output=True, text=True, timeout=120)
    report(v.returncode == 0 and "kv-sidecar" in v.stdout, f"kv-sidecar --version: {v.stdout.strip()}")
    report(
        probe["backend"] == f"nixl_cu{args.cuda_major}",
        f"import nixl selects {probe['backend']} (CUDA {args.cuda_major}) without importing torch: "
        f"{not probe['torch_loaded']}",
    )
    report(not probe["torch_loaded"], "torch was not imported before NIXL initialised UCX")
    report("UCX" in probe["backends"], f"NIXL agent created with backends {probe['backends']}")
    for mod in CUDA_MODULES:
        report(mods.get(mod) == "loaded", f"UCX module {mod}: {mods.get(mod, 'not tried')}")
    t = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    words = t.stdout.split()
    report(
        t.returncode == 0 and len(words) == 3 and words[1].split(".")[0] == args.cuda_major,
        f"torch {' '.join(words[:2])} (a CUDA build), cuda available here: {words[2] if len(words) == 3 else t.stderr[-500:]}",
    )
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
