# Two commands on a fresh machine: `make demo` and `make test` (each installs what it needs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install demo test bench soak diagrams gpu-check graphviz clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev,triton]" "$(TORCH_PIN)"
	@touch $(STAMP)

# SVG rendering needs graphviz's `dot`; DOT and Mermaid sources are produced without it.
graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "graphviz install failed: SVGs skipped"; \
	  else echo "graphviz 'dot' not found (not root): SVGs skipped"; fi; }

demo: install
	$(VENV)/bin/mtp-fsm demo

test: install
	$(PY) -m pytest

bench: install
	$(VENV)/bin/mtp-fsm bench

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

clean:
	rm -rf $(VENV) demo_out .pytest_cache .hypothesis
