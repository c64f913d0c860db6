# Each target sets itself up: a local virtualenv with the CPU build of torch, jax and the test tools.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU wheel this kind of machine serves locally; a bare "torch" would pull a
# multi-GB CUDA build. Installing it first makes the [torch] extra a no-op.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[torch,jax,test,examples]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/vision_encoder.py $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/ruff check dualgraph tests examples benchmarks
	$(VENV)/bin/mypy
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_spec.py

clean:
	rm -rf $(VENV)
