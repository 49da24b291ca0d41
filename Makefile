# `make train` and `make test` work on a fresh machine: they create .venv,
# install tapehook with TensorFlow (CPU) into it and build the kernels.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test kernels clean

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,examples]'
	touch $@

kernels: $(VENV)/.installed
	$(PY) -m tapehook.build

train: kernels
	$(PY) examples/train_digits.py

test: kernels
	TAPEHOOK_KERNELS=compiled $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info

# TF 2.16 ... nightly in fresh venvs; writes docs/compat.md (~15 min, ~30 GB in /tmp).
.PHONY: compat
compat:
	python3 scripts/compat.py
