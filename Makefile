# make demo: set up a virtualenv and run the end-to-end demo.
# make test: set up a virtualenv and run the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): setup.py requirements-hub.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[cpu,test,plots,examples]"
	$(BIN)/pip install --quiet -r requirements-hub.txt
	$(BIN)/pip install --quiet --no-deps keras-hub==0.32.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

bench: $(STAMP)
	$(BIN)/python benchmarks/baselines.py

clean:
	rm -rf $(VENV) out
