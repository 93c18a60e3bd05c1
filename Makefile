# Two entry points (see README): `make demo` plans the embedded default instance, `make test` runs the suite.
# Both create .venv on first use: torch==2.13.0 (CPU) first, explicitly, then hgopt with its extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[runner,test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hgopt plan default

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
