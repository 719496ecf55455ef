"""The environment matrix: ray-ingest installed, as a wheel, into the environment each verl release's users run.

For each ``requirements/envs/<name>.txt`` (a verl release with the versions its own images or setup.py pin):
1. a venv ``.envs/<name>`` gets that file installed, as a user's verl environment would be;
2. this repository's wheel goes in with plain ``pip install``; every package the venv had keeps its version, or the
   entry fails (pip's report names what the wheel would have changed);
3. that release's parity tests, its trainer code with ``VerlDataLoader`` and ``python -m ingest.verl.main_ppo`` run
   in the venv, from a copy of ``tests/`` and ``tools/`` without ``ingest/`` (so the wheel is what they import), with
   the venv's own verl as the oracle (``INGEST_ORACLE_INSTALLED=1``; tools/oracle).

Usage: ``python -m tools.envs [NAME ...] [--keep]`` (all entries by default); ``make test-envs`` runs it. Each venv
takes 6 to 8 GB (its own torch with CUDA libraries), so it is removed once its entry has run and pip's cache is not
used: the run needs room for one venv at a time. With ``--keep`` venvs stay and a later run reuses one while its
requirements file and the versions it had before ray-ingest are unchanged.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ROOT / "requirements" / "envs"
VENVS = ROOT / ".envs"
# the largest entry's venv (8.0 GB) and room for pip to unpack a torch wheel beside it
FREE_GB_NEEDED = 11
# entry -> the test modules it runs: its release's parity tests (each skips what another release's oracle checks),
# the trainer code with VerlDataLoader, and verl's launcher through python -m ingest.verl.main_ppo
COMMON = ["tests/test_parity_tools.py", "tests/test_verl_trainer.py", "tests/test_verl_launcher.py"]
TESTS = {
    "verl-0.5": ["tests/test_parity_text.py", "tests/test_parity_multimodal.py", "tests/test_parity_video.py"],
    "verl-0.6": ["tests/test_parity_verl06.py"],
    "verl-0.7": ["tests/test_parity_verl07.py"],
    "verl-0.9": ["tests/test_parity_verl09.py"],
}


def pip(python: Path, *args: object) -> list[object]:
    """A pip command in ``python``'s venv; no cache: each torch wheel would otherwise stay on disk a second time."""
    return [python, "-m", "pip", *args[:1], "--no-cache-dir", *args[1:]]


def free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**30


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
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


def user_environment(name: str) -> tuple[Path, dict[str, str]]:
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
    run([sys.executable, "-m", "venv", venv])
    run(pip(python, "install", "-q", "--upgrade", "pip"))
    run(pip(python, "install", "-q", "-r", requirements))
    versions = installed(python)
    stamp.write_text(json.dumps({"requirements": digest, "installed": versions}))
    return python, versions


def install_wheel(python: Path, wheel: Path, before: dict[str, str]) -> list[str]:
    """Install ``wheel`` as a user would (plain pip, dependencies resolved); the packages whose version it changed."""
    report = python.parent.parent / "wheel-install.json"
    run([python, "-m", "pip", "uninstall", "-q", "-y", "ray-ingest"])
    run(pip(python, "install", "-q", "--report", report, wheel))
    after = installed(python)
    return [f"{p} {v} -> {after.get(p, 'removed')}" for p, v in sorted(before.items()) if after.get(p) != v]


def install_test_tools(python: Path) -> None:
    """The tests' own tools, held to the versions the venv has where pip finds a way: they add packages (moto's
    boto3) but change none (moto's newest boto3 would otherwise upgrade the botocore that s3fs's aiobotocore pins in
    verl 0.5's entry). Where the venv's versions leave moto no solution (verl 0.6 to 0.9's entries), pip resolves it
    freely and what the tools changed is printed: they are the tests', not the user's."""
    constraints = python.parent.parent / "test-tools-constraints.txt"
    before = {p: v for p, v in installed(python).items() if p not in ("pip", "ray-ingest")}
    constraints.write_text("".join(f"{p}=={v}\n" for p, v in sorted(before.items())))
    tools = pip(python, "install", "-q", "-r", ENTRIES / "tests.txt")
    try:
        run([*tools, "-c", constraints])
    except subprocess.CalledProcessError:
        run(tools)
        after = installed(python)
        changed = [f"{p} {v} -> {after.get(p)}" for p, v in sorted(before.items()) if after.get(p) != v]
        print(f"the tests' tools changed: {', '.join(changed) or 'nothing'}", flush=True)


def copy_tests(name: str) -> Path:
    """``tests/`` and ``tools/`` (and pytest's settings) without ``ingest/``: the tests then import the wheel."""
    work = VENVS / name / "checkout"
    shutil.rmtree(work, ignore_errors=True)
    for folder in ("tests", "tools"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    return work


def smoke_run(python: Path, work: Path) -> str | None:
    """``python -m ingest run`` on 2,000 sample rows in the venv, as a user's first run: None when it ran and its
    summary has every figure (the object store's too), else what went wrong."""
    data = work / "smoke"
    write = f"from ingest.demo import write_gsm8k_parquet; write_gsm8k_parquet({str(data / 'in')!r}, 2000, num_files=2)"
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache")}
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


def run_tests(name: str, python: Path, work: Path, extra: list[str] = ()) -> dict[str, int]:
    """The entry's tests in its venv; the counts of its junit report."""
    junit = work / "junit.xml"
    # a cache of its own: the offline tokenizer is built by this venv's transformers, from the installed package
    env = {**os.environ, "INGEST_ORACLE_INSTALLED": "1", "XDG_CACHE_HOME": str(work / "cache")}
    env.pop("PYTHONPATH", None)
    cmd = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-rs",
        "--timeout=420",
        "--timeout-method=thread",
    ]
    subprocess.run([str(c) for c in [*cmd, *TESTS[name], *COMMON, *extra]], cwd=work, env=env)
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
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(TESTS))
    if unknown:
        parser.error(f"no such entry: {', '.join(unknown)} (choose from {', '.join(TESTS)})")
    args.names, args.pytest = args.names or sorted(TESTS), args.pytest.split()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    wheel = build_wheel()
    results, failed = [], False
    for name in args.names:
        started, built = time.monotonic(), 0.0
        free = free_gb(VENVS)
        if free < FREE_GB_NEEDED and not (VENVS / name / "user-environment.json").is_file():
            print(f"{name}: {free:.1f} GB free under {VENVS}, an entry needs about {FREE_GB_NEEDED} GB", flush=True)
        try:
            python, before = user_environment(name)
            built = time.monotonic() - started
            changed = install_wheel(python, wheel, before)
            if not changed:
                install_test_tools(python)
            work = copy_tests(name)
            smoke = None if changed else smoke_run(python, work)
            counts = run_tests(name, python, work, args.pytest) if not changed else {}
        except subprocess.CalledProcessError as exc:  # an install that failed (a download, say): the next entry runs
            changed, counts, smoke = [], {}, f"{' '.join(map(str, exc.cmd[:6]))} ... failed ({exc.returncode})"
            smoke += f" with {free_gb(VENVS):.1f} GB free"
        if not args.keep:
            shutil.rmtree(VENVS / name, ignore_errors=True)
        ok = not changed and not smoke and counts["passed"] > 0 and not counts["failures"] and not counts["errors"]
        failed |= not ok
        results.append((name, ok, changed, smoke, counts, built, time.monotonic() - started))
    shutil.rmtree(wheel.parent, ignore_errors=True)
    print("\nenvironment matrix (ray-ingest wheel installed into each verl environment):")
    for name, ok, changed, smoke, counts, built, total in results:
        verdict = "ok" if ok else "FAILED"
        detail = f"changed {', '.join(changed)}" if changed else ", ".join(f"{v} {k}" for k, v in counts.items())
        detail += f"; {smoke}" if smoke else "; python -m ingest run ok"
        print(f"  {name:9} {verdict:6} {detail}  (venv {built:.0f} s, total {total:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
