# The two commands of the README: `make demo` (install + run the embedded default) and `make test` (the fast tier);
# `make test-all` is the full suite, what CI runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
ORACLE := .oracle/.installed
ORACLE06 := .oracle-0.6/.installed
ORACLE07 := .oracle-0.7/.installed
ORACLE08 := .oracle-0.8/.installed
ORACLE09 := .oracle-0.9/.installed

.PHONY: install oracle demo test test-all lint bench clean

$(STAMP): requirements/main.txt requirements/test.txt requirements/video.txt pyproject.toml ingest/media/_resize.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements/main.txt -r requirements/test.txt
	$(PIP) install -q --no-deps -e .
	touch $@

install: $(STAMP)

# verl 0.5.0 + transformers 4.57 beside (not inside) the main environment: the parity oracle and bench competitor.
$(ORACLE): requirements/oracle.txt
	rm -rf .oracle
	$(PIP) install -q --no-deps --target .oracle -r requirements/oracle.txt
	touch $@

# verl 0.6.1, the oracle of row_format verl-0.6, beside it (the same transformers 4.57)
$(ORACLE06): requirements/oracle-0.6.txt
	rm -rf .oracle-0.6
	$(PIP) install -q --no-deps --target .oracle-0.6 -r requirements/oracle-0.6.txt
	touch $@

# verl 0.9.1, the oracle of row_format verl-0.9 (transformers 5.9, as verl 0.9.1 pins it)
$(ORACLE09): requirements/oracle-0.9.txt
	rm -rf .oracle-0.9
	$(PIP) install -q --no-deps --target .oracle-0.9 -r requirements/oracle-0.9.txt
	touch $@

# verl 0.8.0, a second oracle of row_format verl-0.9: verl alone, run with .oracle-0.8 in front of .oracle-0.9 (it
# reuses 0.9.1's transformers 5.9 and the rest)
$(ORACLE08): requirements/oracle-0.8.txt
	rm -rf .oracle-0.8
	$(PIP) install -q --no-deps --target .oracle-0.8 -r requirements/oracle-0.8.txt
	touch $@

# verl 0.7.1, the oracle of row_format verl-0.7: verl alone, run like 0.8.0 in front of .oracle-0.9
$(ORACLE07): requirements/oracle-0.7.txt
	rm -rf .oracle-0.7
	$(PIP) install -q --no-deps --target .oracle-0.7 -r requirements/oracle-0.7.txt
	touch $@

oracle: $(ORACLE) $(ORACLE06) $(ORACLE07) $(ORACLE08) $(ORACLE09)

demo: $(STAMP)
	$(PY) -m ingest make-tokenizer
	$(PY) -m ingest run --output out/demo --summary-json out/demo/summary.json

# torchcodec (a test requirement) finds FFmpeg through PyAV's libraries: the vision_video_decoder tests use it.
# --durations: every run prints its slowest tests, so the tiers' budgets (10 and 30 minutes of pytest) can be kept.
PYTEST := LD_LIBRARY_PATH=$$($(PY) -m ingest ffmpeg-libdir)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} $(PY) -m pytest -q

# The fast tier: every module, one parity case per row format against its own verl; tests marked `slow` wait for
# test-all.
test: $(STAMP) $(ORACLE) $(ORACLE06) $(ORACLE07) $(ORACLE08) $(ORACLE09)
	$(PY) -m ruff check ingest actors tests tools
	$(PYTEST) --durations=15 -m "not slow" tests

# Everything: the clusters, node loss, job submission, every parity case and the long fuzz runs.
test-all: $(STAMP) $(ORACLE) $(ORACLE06) $(ORACLE07) $(ORACLE08) $(ORACLE09)
	$(PY) -m ruff check ingest actors tests tools
	$(PYTEST) --durations=25 tests

lint: $(STAMP)
	$(PY) -m ruff check ingest actors tests tools
	$(PY) -m ruff format --check ingest actors tests tools

bench: $(STAMP) $(ORACLE)
	$(PY) -m ingest bench text --rows 20000 200000

clean:
	rm -rf $(VENV) .oracle .oracle-0.6 .oracle-0.7 .oracle-0.8 .oracle-0.9 out
