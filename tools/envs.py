"""The environment matrix: ray-ingest installed, as a wheel, into the environment each verl release's users run.

For each ``requirements/envs/<name>.txt`` (a verl release with the versions its own images or setup.py pin):
1. a venv ``.envs/<name>`` gets that file installed, as a user's verl environment would be;
2. ray-ingest goes in by the README's install lines, as written (the environment's versions as constraints, every
   extra; one entry from a copy of the clone, the others from this repository's wheel); every package the venv had
   keeps its version, or the entry fails (pip's refusal names the conflict);
3. that release's parity tests, its trainer code with ``VerlDataLoader``, ``python -m ingest.verl.main_ppo`` and,
   where the release has an agent loop, the media hand-off against it run in the venv, from a copy of ``tests/`` and
   ``tools/`` without ``ingest/`` (so the wheel is what they import), with the venv's own verl as the oracle
   (``INGEST_ORACLE_INSTALLED=1``; tools/oracle).

``--tier ci`` (``make test-envs-ci``, what CI runs) runs steps 1 and 2 and, of step 3, the tests marked ``matrix``:
one parity case of each kind of row the release has, the hand-off and ``main_ppo`` up to placement.

Usage: ``python -m tools.envs [NAME ...] [--tier ci] [--keep]`` (all entries by default); ``make test-envs`` runs
it. Each venv takes 6 to 8 GB (its own torch with CUDA libraries), so it is removed once its entry has run and pip's
cache is not used. Two entries run at a time (``--lanes``), each with its own Ray temp dir and log, where the disk
holds two venvs; else one. With ``--keep`` venvs stay and a later run reuses one while its requirements file and the
versions it had before ray-ingest are unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "requirements" / "envs"
VENVS = ROOT / ".envs"
# the largest entry's venv (8.0 GB) and room for pip to unpack a torch wheel beside it
FREE_GB_NEEDED = 11
# entry -> the test modules it runs: its release's parity tests (each skips what another release's oracle checks),
# the trainer code with VerlDataLoader, and verl's launcher through python -m ingest.verl.main_ppo
COMMON = ["tests/test_parity_tools.py", "tests/test_verl_trainer.py", "tests/test_verl_launcher.py"]
HANDOFF = "tests/test_rollout_media.py::test_handed_off_media_give_verls_agent_loop_inputs"
V1_HANDOFF = "tests/test_rollout_media.py::test_handed_off_media_give_verls_v1_agent_loop_inputs"  # 0.9's default
TESTS = {
    "verl-0.5": ["tests/test_parity_text.py", "tests/test_parity_multimodal.py", "tests/test_parity_video.py"],
    "verl-0.6": ["tests/test_parity_verl06.py"],
    "verl-0.7": ["tests/test_parity_verl07.py", HANDOFF],
    "verl-0.9": ["tests/test_parity_verl09.py", HANDOFF, V1_HANDOFF],
}
# The README's install block (README_INSTALL's fenced block) is what each entry runs, with every extra a user adds;
# one entry installs from a copy of the clone, the others from the wheel
README_INSTALL = "### Install into your verl environment"
EXTRAS = "[verl,s3]"
CLONE_FORM_ENTRY = "verl-0.5"
# the tier's pytest selection: "full" runs the modules whole, "ci" the tests marked `matrix` in them
TIERS = {"full": [], "ci": ["-m", "matrix"]}


def pip(python: Path, *args: object) -> list[object]:
    """A pip command in ``python``'s venv; no cache: each torch wheel would otherwise stay on disk a second time."""
    return [python, "-m", "pip", *args[:1], "--no-cache-dir", *args[1:]]


def free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**30


def run(cmd: list[str], log: TextIO | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``cmd``, echoed and checked; with ``log``, it and its output go there (an entry run beside another)."""
    print("+", " ".join(str(c) for c in cmd), file=log or sys.stdout, flush=True)
    if log is not None:
        kwargs = {"stdout": log, "stderr": subprocess.STDOUT, **kwargs}
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def build_wheel() -> Path:
    """The wheel and sdist of this checkout (``python -m build``), built once per run, in a folder of the run's own."""
    VENVS.mkdir(exist_ok=True)
    dist = Path(tempfile.mkdtemp(prefix="dist-", dir=VENVS))
    run([sys.executable, "-m", "build", "--outdir", dist, ROOT], stdout=subprocess.DEVNULL)
    wheels = sorted(dist.glob("ray_ingest-*.whl"))
    assert wheels and sorted(dist.glob("ray_ingest-*.tar.gz")), sorted(dist.iterdir())
    return wheels[0]


def installed(python: Path) -> dict[str, str]:
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], check=True, capture_output=True, text=True)
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed.stdout)}


def user_environment(name: str, log: TextIO | None = None) -> tuple[Path, dict[str, str]]:
    """The venv of entry ``name`` with its requirements installed, and the versions it had before ray-ingest."""
    requirements = ENTRIES / f"{name}.txt"
    venv = VENVS / name
    python = venv / "bin" / "python"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    stamp = venv / "user-environment.json"
    if stamp.is_file() and json.loads(stamp.read_text())["requirements"] == digest:
        versions = json.loads(stamp.read_text())["installed"]
        now = installed(python)
        if all(now.get(p) == v for p, v in versions.items()):  # else an earlier run changed it: build it again
            return python, versions
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", venv], log)
    run(pip(python, "install", "-q", "--upgrade", "pip"), log)
    run(pip(python, "install", "-q", "-r", requirements), log)
    versions = installed(python)
    stamp.write_text(json.dumps({"requirements": digest, "installed": versions}))
    return python, versions


def readme_install_lines() -> list[str]:
    """The README's install commands, as a user types them: the environment's versions as constraints, the install
    from a clone, the install from a wheel (comments dropped)."""
    text = (ROOT / "README.md").read_text().split(README_INSTALL, 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def copy_clone(dest: Path) -> Path:
    """This repository's tracked files at ``dest``: what a user's clone holds (pip builds in the folder it installs)."""
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True, capture_output=True, text=True)
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def install_as_readme(
    name: str, python: Path, wheel: Path, before: dict[str, str], log: TextIO | None = None
) -> list[str]:
    """Install ray-ingest as the README says, its lines run as written with the venv's pip first on PATH and every
    extra a user adds (``EXTRAS``): the environment's versions as constraints (pip keeps each or refuses, and a refusal
    fails the entry with pip's reason in its log), then from a copy of the clone (``CLONE_FORM_ENTRY``) or from the
    wheel. The packages whose version it changed."""
    freeze, from_clone, from_wheel = readme_install_lines()
    venv = python.parent.parent
    run([python, "-m", "pip", "uninstall", "-q", "-y", "ray-ingest"], log)  # a kept venv's, not the user's
    if name == CLONE_FORM_ENTRY:
        where, line = copy_clone(venv / "clone"), from_clone
    else:
        where, line = venv / "wheel-install", from_wheel
        shutil.rmtree(where, ignore_errors=True)  # a kept venv's earlier wheel would be listed too
        (where / "dist").mkdir(parents=True)
        shutil.copy(wheel, where / "dist" / wheel.name)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}", "PIP_NO_CACHE_DIR": "1"}
    for command in (freeze, line.replace("[verl]", EXTRAS)):
        run(["bash", "-c", command], log, cwd=where, env=env)
    after = installed(python)
    if "ray-ingest" not in after:
        raise subprocess.CalledProcessError(1, ["bash", "-c", line, "(ray-ingest not installed)"])
    return [f"{p} {v} -> {after.get(p, 'removed')}" for p, v in sorted(before.items()) if after.get(p) != v]


def install_test_tools(python: Path, log: TextIO | None = None) -> None:
    """The tests' own tools (pytest and its timeout plugin), held to the versions the venv has where pip finds a way;
    else resolved freely, with what they changed printed: they are the tests', not the user's. (None of the matrix's
    modules reads S3, so moto is not among them: under verl 0.6 to 0.9's pins it had no solution, and pip took
    minutes to find that out in each entry.)"""
    constraints = python.parent.parent / "test-tools-constraints.txt"
    before = {p: v for p, v in installed(python).items() if p not in ("pip", "ray-ingest")}
    constraints.write_text("".join(f"{p}=={v}\n" for p, v in sorted(before.items())))
    tools = pip(python, "install", "-q", "-r", ENTRIES / "tests.txt")
    try:
        run([*tools, "-c", constraints], log)
    except subprocess.CalledProcessError:
        run(tools, log)
        after = installed(python)
        changed = [f"{p} {v} -> {after.get(p)}" for p, v in sorted(before.items()) if after.get(p) != v]
        print(f"the tests' tools changed: {', '.join(changed) or 'nothing'}", file=log or sys.stdout, flush=True)


@dataclass
class Prepared:
    """An entry's venv, made ready for its tests: its requirements, then the wheel, then the tests' tools."""

    name: str
    python: Path | None = None
    changed: list[str] = field(default_factory=list)  # the versions the wheel changed (then no tools, no tests)
    failed: str | None = None  # the install that failed, with the free space then
    built_s: float = 0.0  # the venv with the entry's requirements


def prepare(name: str, wheel: Path, log: TextIO | None = None) -> Prepared:
    """Entry ``name``'s venv with its requirements, the wheel and the tests' tools; an install that fails (a download
    cut off, a full disk) is recorded, not raised, so the other entries still run."""
    started, entry = time.monotonic(), Prepared(name)
    free = free_gb(VENVS)
    if free < FREE_GB_NEEDED and not (VENVS / name / "user-environment.json").is_file():
        print(
            f"{name}: {free:.1f} GB free under {VENVS}, an entry needs about {FREE_GB_NEEDED} GB", file=log, flush=True
        )
    try:
        entry.python, before = user_environment(name, log)
        entry.built_s = time.monotonic() - started
        entry.changed = install_as_readme(name, entry.python, wheel, before, log)
        if not entry.changed:
            install_test_tools(entry.python, log)
    except subprocess.CalledProcessError as exc:
        entry.failed = (
            f"{' '.join(map(str, exc.cmd[:6]))} ... failed ({exc.returncode}) with {free_gb(VENVS):.1f} GB free"
        )
    return entry


def copy_tests(name: str, python: Path) -> Path:
    """``tests/`` and ``tools/`` (and pytest's settings) without ``ingest/``: the tests then import the wheel. Their
    bytecode is written here, as pip wrote the wheel's: where PYTHONDONTWRITEBYTECODE is set, no process that imports
    them would, and each would compile them again."""
    work = VENVS / name / "checkout"
    shutil.rmtree(work, ignore_errors=True)
    for folder in ("tests", "tools"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    subprocess.run([python, "-m", "compileall", "-q", work / "tests", work / "tools"], check=True, capture_output=True)
    return work


def entry_environment(name: str, work: Path) -> dict[str, str]:
    """The variables an entry's runs get: a cache of its own (the offline tokenizer is built there by the venv's
    transformers, from the installed package), a Ray temp dir of its own (entries run side by side: a `ray start` head
    of one is then never "the" cluster of the machine for another), and no PYTHONPATH (the wheel is what they
    import)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "RAY_TMPDIR": f"/tmp/ingest-envs/{name}"}
    env.pop("PYTHONPATH", None)
    return env


def smoke_run(name: str, python: Path, work: Path) -> str | None:
    """``python -m ingest run`` on 2,000 sample rows in the venv, as a user's first run: None when it ran and its
    summary has every figure (the object store's too), else what went wrong."""
    data = work / "smoke"
    write = f"from ingest.demo import write_gsm8k_parquet; write_gsm8k_parquet({str(data / 'in')!r}, 2000, num_files=2)"
    env = entry_environment(name, work)
    subprocess.run([python, "-c", write], check=True, cwd=work, env=env)
    summary, config = data / "summary.json", data / "config.yaml"
    config.write_text("row_format: auto\n")  # the installed verl's rows (its release refuses any other format)
    cmd = [python, "-m", "ingest", "run", config, "--files", data / "in", "--summary-json", summary]
    done = subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return f"python -m ingest run failed: {done.stderr[-2000:]}"
    figures = json.loads(summary.read_text())
    if figures.get("object_store") is None:
        return "python -m ingest run: the object store figures are unknown"
    if figures["rows_in"] != 2000:
        return f"python -m ingest run read {figures['rows_in']} rows, not 2000"
    return None


def run_tests(name: str, python: Path, work: Path, extra: list[str] = (), log: TextIO | None = None) -> dict[str, int]:
    """The entry's tests in its venv (their output to ``log``); the counts of its junit report."""
    junit = work / "junit.xml"
    env = {**entry_environment(name, work), "INGEST_ORACLE_INSTALLED": "1"}
    cmd = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-rs",
        "--durations=10",  # in the entry's log: where its time went
        "--timeout=420",
        "--timeout-method=thread",
    ]
    output = {"stdout": log, "stderr": subprocess.STDOUT} if log is not None else {}
    subprocess.run([str(c) for c in [*cmd, *TESTS[name], *COMMON, *extra]], cwd=work, env=env, **output)
    if not junit.is_file():  # pytest-timeout's thread method ended the whole session: no report
        return {"tests": 0, "failures": 0, "errors": 1, "skipped": 0, "passed": 0}
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The entries to run (``names``: all by default), the extra pytest arguments and whether venvs are kept."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # checked here, not with argparse's choices: with nargs="*" it checks an empty list (or a default) as one value
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"entries (default: all of {', '.join(TESTS)})")
    parser.add_argument("--pytest", default="", help="more pytest arguments, e.g. '-x -k text'")
    parser.add_argument("--keep", action="store_true", help="keep each venv for the next run (6 to 8 GB each)")
    parser.add_argument("--tier", choices=sorted(TIERS), default="full", help="ci: the tests marked `matrix` only")
    parser.add_argument(
        "--prepare", action="store_true", help="only build the entries' own environments, kept for a later run"
    )
    parser.add_argument("--lanes", type=int, default=2, help="entries run at a time (default 2; 1 where disk is short)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(TESTS))
    if unknown:
        parser.error(f"no such entry: {', '.join(unknown)} (choose from {', '.join(TESTS)})")
    args.names, args.pytest = args.names or sorted(TESTS), TIERS[args.tier] + args.pytest.split()
    return args


@dataclass
class Outcome:
    """What one entry's turn gave: its venv (``Prepared``), the smoke run's problem (or the failed install), the
    junit counts, and its wall time."""

    entry: Prepared
    problem: str | None
    counts: dict[str, int]
    seconds: float

    @property
    def ok(self) -> bool:
        passed = bool(self.counts) and self.counts["passed"] > 0
        return (
            not self.entry.changed
            and not self.problem
            and passed
            and not self.counts["failures"] + self.counts["errors"]
        )

    def line(self) -> str:
        detail = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        detail = f"changed {', '.join(self.entry.changed)}" if self.entry.changed else detail
        detail += f"; {self.problem}" if self.problem else "; python -m ingest run ok"
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{self.entry.name:9} {verdict:6} {detail}  (venv {self.entry.built_s:.0f} s, total {self.seconds:.0f} s)"
        )


def run_entry(name: str, wheel: Path, extra: list[str], keep: bool, log: TextIO | None = None) -> Outcome:
    """One entry, whole: its venv, the wheel, the smoke run and its tests (their output to ``log``); the venv is
    removed afterwards unless ``keep``."""
    started = time.monotonic()
    entry = prepare(name, wheel, log)
    problem, counts = entry.failed, {}
    if entry.python is not None and not entry.changed and not entry.failed:
        try:
            work = copy_tests(name, entry.python)
            problem = smoke_run(name, entry.python, work)
            counts = run_tests(name, entry.python, work, extra, log)
        except (OSError, subprocess.SubprocessError) as exc:  # a copy or the smoke data not written, a run too long
            problem = f"{type(exc).__name__}: {exc}"
    if not keep:
        shutil.rmtree(VENVS / name, ignore_errors=True)
    return Outcome(entry, problem, counts, time.monotonic() - started)


def prepare_environments(names: list[str]) -> int:
    """Each entry's own environment (its requirements, no ray-ingest), built one after another and kept, for a run
    later that finds it ready: ``.ci/run`` builds them while ``make test-all`` runs (they are mostly downloads, the
    tests mostly CPU). An entry the disk has no room for, or whose install fails, is left to that run."""
    VENVS.mkdir(exist_ok=True)
    for name in names:
        started = time.monotonic()
        if free_gb(VENVS.parent) < FREE_GB_NEEDED + 4:  # leave the tests room for their files
            print(f"{name}: {free_gb(VENVS.parent):.1f} GB free; left to the run", flush=True)
            continue
        try:
            user_environment(name)
        except subprocess.CalledProcessError as exc:
            print(f"{name}: {' '.join(map(str, exc.cmd[:6]))} ... failed ({exc.returncode}); left to the run")
            shutil.rmtree(VENVS / name, ignore_errors=True)
            continue
        print(f"{name}: its environment is ready ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.prepare:
        return prepare_environments(args.names)
    wheel = build_wheel()
    started = time.monotonic()
    # Two entries at a time where the disk holds two venvs: one's downloads and its tests' waits (subprocesses, Ray
    # starting) leave a core idle that the other uses. Each writes to a log of its own, printed when it ends.
    lanes = min(args.lanes, len(args.names))
    if lanes > 1 and free_gb(VENVS) < lanes * FREE_GB_NEEDED:
        print(f"{free_gb(VENVS):.1f} GB free under {VENVS}: one entry at a time", flush=True)
        lanes = 1
    outcomes = []
    if lanes == 1:
        outcomes = [run_entry(name, wheel, args.pytest, args.keep) for name in args.names]
    else:
        logs = {name: VENVS / f"{name}.log" for name in args.names}

        def logged(name: str) -> Outcome:
            with open(logs[name], "w") as log:
                return run_entry(name, wheel, args.pytest, args.keep, log)

        with ThreadPoolExecutor(max_workers=lanes) as pool:
            running = {pool.submit(logged, name): name for name in args.names}
            for done in as_completed(running):
                print(f"\n== {running[done]}\n{logs[running[done]].read_text()}", end="", flush=True)
                outcomes.append(done.result())
    shutil.rmtree(wheel.parent, ignore_errors=True)
    print("\nenvironment matrix (ray-ingest wheel installed into each verl environment):")
    for outcome in sorted(outcomes, key=lambda o: o.entry.name):
        print(f"  {outcome.line()}")
    print(f"  {lanes} at a time: {time.monotonic() - started:.0f} s in all")
    record_phases(outcomes)
    return 0 if all(outcome.ok for outcome in outcomes) else 1


def record_phases(outcomes: list[Outcome]) -> None:
    """Each entry's seconds (its venv's among them) in the file ``.ci/run`` reports its phases from, where set."""
    phases = os.environ.get("CI_PHASES_FILE")
    if not phases:
        return
    with open(phases, "a") as out:
        for outcome in sorted(outcomes, key=lambda o: o.entry.name):
            name = f"  matrix {outcome.entry.name} (venv {outcome.entry.built_s:.0f} s)"
            out.write(f"{name:34} {outcome.seconds:6.0f} s{'' if outcome.ok else '  FAILED'}\n")


if __name__ == "__main__":
    sys.exit(main())
