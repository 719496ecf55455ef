# The two commands of the README: `make demo` (install + run the embedded default) and `make test` (the fast tier);
# `make test-all` is the full suite, what CI runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
ORACLES := .oracle/.installed .oracle-0.6/.installed .oracle-0.7/.installed .oracle-0.8/.installed .oracle-0.9/.installed

.PHONY: install oracle demo test test-all test-envs test-envs-ci lint bench wheel clean

# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), no process writes the bytecode of what it
# imports: every Ray worker would compile this checkout's modules again. pip compiles what it installs; this compiles
# the checkout's own (at install, and before each test run for the files changed since).
BYTECODE := $(PY) -m compileall -q ingest actors tests tools

# pip shows no build output, so a build that found no C compiler says so here (and the run summary says it too)
NO_C_RESIZE := note: the C image resize was not built (no C compiler or Python headers); the CPU vision actors use \
torch's kernel: the same pixels, a slower start

$(STAMP): requirements/main.txt requirements/test.txt requirements/video.txt pyproject.toml ingest/media/_resize.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements/main.txt -r requirements/test.txt
	$(PIP) install -q --no-deps -e .
	@$(PY) -c 'import ingest.media._resize' 2>/dev/null || echo "$(NO_C_RESIZE)"
	$(BYTECODE)
	touch $@

install: $(STAMP)

# The verl releases the tests compare against, each installed beside (not inside) the main environment from its
# requirements/oracle*.txt and run in a subprocess with its folder in front of PYTHONPATH (tools/oracle):
#   .oracle      verl 0.5.0 + transformers 4.57: row_format verl-0.5, and the benchmarks' competitor
#   .oracle-0.6  verl 0.6.1 (the same transformers 4.57): verl-0.6
#   .oracle-0.9  verl 0.9.1 (transformers 5.9, as it pins it): verl-0.9
#   .oracle-0.8  verl 0.8.0 alone, run in front of .oracle-0.9 (its transformers and the rest): a second verl-0.9 oracle
#   .oracle-0.7  verl 0.7.1 alone, run like 0.8.0 in front of .oracle-0.9: verl-0.7
$(ORACLES): .%/.installed: requirements/%.txt
	rm -rf .$*
	$(PIP) install -q --no-deps --target .$* -r $<
	touch $@

oracle: $(ORACLES)

demo: $(STAMP)
	$(PY) -m ingest make-tokenizer
	$(PY) -m ingest run --output out/demo --summary-json out/demo/summary.json

# torchcodec (a test requirement) finds FFmpeg through PyAV's libraries: the vision_video_decoder tests use it.
# --durations: every run prints its slowest tests, so the tiers' budgets can be kept (the fast one: 10 minutes); each
# lane's JUnit XML (out/TIER-main.xml, out/TIER-side.xml) holds every test's seconds, to balance the lanes by.
# The tests' clusters run Ray's monitors at a slower pace (both cost CPU that the tests' pipelines want): the log
# monitor looks for new log files every 0.5 s from the start, as Ray does once a cluster has 1,000 of them (not every
# 0.1 s), and each node's dashboard agent reports its processes' stats to a dashboard every 30 s (not 5 s).
RAY_MONITORS := RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0 REPORTER_UPDATE_INTERVAL_MS=30000
PYTEST := $(RAY_MONITORS) LD_LIBRARY_PATH=$$($(PY) -m ingest ffmpeg-libdir)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} $(PY) -m pytest -q

# $(call RECORD,NAME,START): where CI_PHASES_FILE is set (.ci/run), add NAME's seconds since START (date +%s) to it
RECORD = [ -z "$$CI_PHASES_FILE" ] || printf '%-34s %6d s\n' $(1) $$(( $$(date +%s) - $(2) )) >> "$$CI_PHASES_FILE"

# The tiers run two pytests at once, each with a Ray temp dir of its own (no `ray start` head of one is then "the"
# cluster of this machine for the other): the main one, and a side lane of the modules that spend their time in
# subprocesses (clusters, verl's trainers and launcher, CLI runs) or in waits (S3 retries). The side lane's report
# follows the main one. (Three lanes, with the matrix's installs beside them, overloaded a 2-core VM until Ray's node
# starts timed out.)
SIDE_TESTS := tests/test_node_loss.py tests/test_cluster.py tests/test_layout.py tests/test_object_store_pressure.py \
	tests/test_verl_launcher.py tests/test_verl_trainer.py tests/test_rollout_media.py tests/test_cli.py tests/test_install.py \
	tests/test_sft_renderers.py
# The fast tier's side lane also takes resume and the S3 faults: in test-all the slow cases above fill the side lane
# (the verl 0.9.1 agent-loop checks the largest), and these two even the lanes out from the main one
# (docs/benchmarks.md).
FAST_SIDE_TESTS := $(SIDE_TESTS) tests/test_resume.py tests/test_faults_s3.py
# $(call LANES,TIER,ARGS,SIDE): the tier's two pytests (pytest ARGS: the tier's selection; SIDE: the side lane's
# modules), failing if either fails
LANES = mkdir -p out; started=$$(date +%s); \
	( RAY_TMPDIR=/tmp/ingest-tests $(PYTEST) -p no:cacheprovider --durations=10 --junitxml=out/$(1)-side.xml $(2) $(3) \
		> out/$(1)-side.log 2>&1; rc=$$?; $(call RECORD,"  $(1): side pytest",$$started); exit $$rc ) & side=$$!; \
	$(PYTEST) --durations=25 --junitxml=out/$(1)-main.xml $(2) $(addprefix --ignore=,$(3)) tests; main=$$?; \
	$(call RECORD,"  $(1): main pytest",$$started); \
	wait $$side; side_rc=$$?; echo "== $(3)"; cat out/$(1)-side.log; \
	exit $$(( main || side_rc ))

# The fast tier: every module, one parity case per row format against its own verl; tests marked `slow` wait for
# test-all.
test: $(STAMP) $(ORACLES)
	$(PY) -m ruff check ingest actors tests tools
	$(BYTECODE)
	$(call LANES,test,-m "not slow",$(FAST_SIDE_TESTS))

# Everything: the clusters, node loss, job submission, every parity case and the long fuzz runs.
test-all: $(STAMP) $(ORACLES)
	$(PY) -m ruff check ingest actors tests tools
	$(BYTECODE)
	$(call LANES,test-all,,$(SIDE_TESTS))

# The environment matrix: this package's wheel installed with plain pip into each verl release's own environment
# (requirements/envs/), which it must leave unchanged, then that release's parity, trainer and launcher tests there.
test-envs: $(STAMP)
	$(RAY_MONITORS) $(PY) -m tools.envs

# The matrix's CI tier, what .ci/run runs: in each verl release's own environment, the wheel changes no version,
# `python -m ingest run` runs, and the tests marked `matrix` run (one parity case per kind of row that release has,
# the hand-off against its agent loop where it has one, `main_ppo` up to placement).
test-envs-ci: $(STAMP)
	$(RAY_MONITORS) $(PY) -m tools.envs --tier ci

lint: $(STAMP)
	$(PY) -m ruff check ingest actors tests tools
	$(PY) -m ruff format --check ingest actors tests tools

# the wheel (and sdist) to install into another environment: ray-ingest is not on PyPI
wheel: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	@$(PY) -c 'import glob, sys, zipfile; sys.exit(not any(n.startswith("ingest/media/_resize.") and n.endswith(".so") \
	  for n in zipfile.ZipFile(glob.glob("dist/*.whl")[0]).namelist()))' || echo "$(NO_C_RESIZE)"

bench: $(STAMP) .oracle/.installed
	$(PY) -m ingest bench text --rows 20000 200000

clean:
	rm -rf $(VENV) .oracle .oracle-0.6 .oracle-0.7 .oracle-0.8 .oracle-0.9 .envs dist out
