# `make train` and `make test` work on a fresh machine: they create .venv,
# install tapehook with TensorFlow (CPU) into it and build the kernels.
VENV ?= .venv
PY := $(VENV)/bin/python
# What clang-format checks: the C++ and CUDA sources, kernels and their tests.
CC_SOURCES = $(shell find cc_kernels tests/cc -name '*.cc' -o -name '*.h' -o -name '*.cu' | sort)

.PHONY: train test test-fast kernels lint format clean

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,examples,lint]'
	touch $@

kernels: $(VENV)/.installed
	$(PY) -m tapehook.build

train: kernels
	$(PY) examples/train_digits.py

test: kernels
	TAPEHOOK_KERNELS=compiled $(PY) -m pytest -q --durations=25 tests

# The inner loop: stop at the first failure, skip tests marked slow (pytest.ini).
test-fast: kernels
	TAPEHOOK_KERNELS=compiled $(PY) -m pytest -x -q -m "not slow" tests

# Checks only; `make format` applies what these ask for. Also checks that
# docs/performance.md, docs/models.md and the README headline are what
# bench/results says, and builds the documentation site (mkdocs.yml) into site/
# with --strict: a broken link, a missing page or a docstring that does not
# render fails it.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CC_SOURCES)
	$(PY) bench/table.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Applies the fixable lint fixes and both formatters (what is left, `make lint`
# reports). clang-format runs twice: a braced list with /*name=*/ comments can
# take it two passes to settle.
format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix --exit-zero .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CC_SOURCES)
	$(VENV)/bin/clang-format -i $(CC_SOURCES)

clean:
	rm -rf $(VENV) build *.egg-info

# TF 2.16 ... nightly in fresh venvs; writes docs/compat.md (~15 min, ~30 GB in /tmp).
.PHONY: compat
compat:
	python3 scripts/compat.py
