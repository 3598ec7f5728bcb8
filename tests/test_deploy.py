"""deploy/ checked without a cluster or a container daemon (docs/deploy.md).

Kubernetes: every overlay assembled as kustomize would (kubectl's kustomize where it exists,
compared with tests/deploy_support.py's assembly), every document read strictly into the
``kubernetes`` client's models, every container's arguments parsed by blendmatch's own
parser (a renamed flag fails here), every probe path a route of the app, the writable paths
exactly where the server writes. The scanner (checkov) on the assembled manifests and the
Dockerfiles, when it is installed. The compose fleet, the systemd unit and the container
recipe the same way; the install script in a temporary folder (slow).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from blendmatch.service.access import AccessPolicy
from blendmatch.service.cli import build_parser
from blendmatch.service.flags import config_from_args
from deploy_support import assemble, env_expand, exec_argv, strict_model, unit_file

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
DOCKERFILES = sorted((DEPLOY / "container").glob("Dockerfile*"))
#: resident bytes per stored chunk through the service at 1M chunks (docs/performance.md,
#: "Resident bytes per chunk at 1M chunks": 1,446-1,524 B) and the sizing the manifests promise
BYTES_PER_CHUNK, SIZED_FOR_CHUNKS = 1_524, 1_000_000


def serve_config(args: list[str]):
    """``args`` as ``blendmatch serve`` reads them: argparse, then the settings' validation."""
    return config_from_args(build_parser().parse_args(["serve", *args]))


def app_paths() -> set[str]:
    from blendmatch.service.app import create_app
    from blendmatch.service.config import ServiceConfig

    return {r.path for r in create_app(ServiceConfig()).routes if hasattr(r, "path")}


@pytest.fixture(scope="module")
def routes() -> set[str]:
    return app_paths()


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, assemble(KUSTOMIZE / "overlays" / request.param)


def _workloads(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", q)
    assert m, f"memory quantity {q!r}"
    return int(m.group(1)) * units[m.group(2)]


# ------------------------------------------------------------------ kubernetes
def test_the_overlays_are_the_shapes_docs_deploy_md_names():
    assert OVERLAYS == ["coordinator", "coordinator-gpu", "coordinator-tls", "replicas"]


def test_assembly_equals_kubectl_kustomize(overlay):
    name, docs = overlay
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its built-in kustomize) is not installed; the manifests are checked on this "
                    "test's own assembly")
    out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE / "overlays" / name)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr

    def key(d):
        return d["kind"], d["metadata"]["name"]

    assert sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=key) == sorted(docs, key=key)


def test_every_document_is_a_kubernetes_model_with_no_unknown_field(overlay):
    _name, docs = overlay
    for d in docs:
        if d["kind"] != "ServiceMonitor":  # a CRD: checked below
            strict_model(d)
        assert d["metadata"]["namespace"] == "blendmatch"
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "blendmatch"


def test_the_strict_reading_refuses_an_unknown_field_and_a_wrong_type(overlay):
    _name, docs = overlay
    (workload,) = _workloads(docs)
    bad = json.loads(json.dumps(workload))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pathh"] = "/healthz"
    with pytest.raises(ValueError, match="pathh"):
        strict_model(bad)
    bad = json.loads(json.dumps(workload))
    bad["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = 3
    with pytest.raises(ValueError, match="memory"):
        strict_model(bad)


def test_every_container_argument_parses_with_blendmatchs_parser(overlay):
    _name, docs = overlay
    for w in _workloads(docs):
        pod = w["spec"]["template"]["spec"]
        (main,) = pod["containers"]
        assert "command" not in main, "the image's entry point is `blendmatch serve`; args are its flags"
        env = {e["name"]: (e.get("value") or f"<{e['valueFrom']['fieldRef']['fieldPath']}>") for e in main["env"]}
        config = serve_config([env_expand(a, env) for a in main["args"]])
        assert config.port == 9300 and config.access_file == "/etc/blendmatch/access.toml"
        assert config.checkpoint_path, "a checkpoint on the volume"
        cpu_limit = int(main["resources"]["limits"]["cpu"])
        assert config.engine_threads == max(1, cpu_limit - 1), "one core kept for the event loop"
        assert w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.graceful_timeout
        memory = _quantity_bytes(main["resources"]["limits"]["memory"])
        assert memory == _quantity_bytes(main["resources"]["requests"]["memory"])
        assert memory >= SIZED_FOR_CHUNKS * BYTES_PER_CHUNK + config.max_bytes_in_flight + (256 << 20)
        for c in pod["initContainers"]:
            assert c["command"][:2] == ["sh", "-c"] and c["image"] == main["image"]


def test_a_renamed_flag_fails_the_argument_check():
    with pytest.raises(SystemExit):
        serve_config(["--checkpoint-pathh=/var/lib/blendmatch/blendmatch.ckpt"])


def test_probe_paths_are_routes_of_the_app_and_ports_are_the_served_one(overlay, routes):
    _name, docs = overlay
    for w in _workloads(docs):
        (main,) = w["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        probes = {k: main[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/healthz"
        assert probes["readinessProbe"]["path"] == "/readyz"
        tls = any(a.startswith("--ssl-certfile") for a in main["args"])
        for probe in probes.values():
            assert probe["path"] in routes
            assert ports[probe["port"]] == 9300
            assert probe.get("scheme", "HTTP") == ("HTTPS" if tls else "HTTP")


def test_writable_volumes_are_exactly_where_the_server_writes(overlay):
    _name, docs = overlay
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for w in _workloads(docs):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in pod["volumes"]}
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        (main,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in main["env"]}
        config = serve_config([env_expand(a, {"POD_NAME": "p-0"}) for a in main["args"]])
        for c in pod["initContainers"] + pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["runAsNonRoot"] is True and sc["capabilities"]["drop"] == ["ALL"]
        writable = {m["mountPath"]: m["name"] for m in main["volumeMounts"] if not m.get("readOnly")}
        # the checkpoint's folder (file, <path>.tmp-<pid>, <path>.lock) and the JIT cache
        assert set(writable) == {os.path.dirname(config.checkpoint_path), env["BLENDMATCH_CACHE_DIR"]}
        ckpt = writable[os.path.dirname(config.checkpoint_path)]
        assert ckpt in templates or volumes[ckpt]["persistentVolumeClaim"]["claimName"] in claims
        assert "emptyDir" in volumes[writable[env["BLENDMATCH_CACHE_DIR"]]]
        (init,) = pod["initContainers"]  # seeds the cache volume from the image's compiled cache
        assert init["command"][2].endswith(f" {env['BLENDMATCH_CACHE_DIR']}/")
        assert [m["mountPath"] for m in init["volumeMounts"]] == [env["BLENDMATCH_CACHE_DIR"]]
        ro = {m["mountPath"]: volumes[m["name"]] for m in main["volumeMounts"] if m.get("readOnly")}
        access_dir, access_key = os.path.split(config.access_file)
        assert access_key in configmaps[ro[access_dir]["configMap"]["name"]]["data"]
        if config.ssl_certfile:
            assert ro[os.path.dirname(config.ssl_certfile)]["secret"]["secretName"] == "blendmatch-tls"


def test_coordinator_is_one_pod_recreated_and_replicas_have_stable_ids(overlay):
    name, docs = overlay
    (w,) = _workloads(docs)
    (main,) = w["spec"]["template"]["spec"]["containers"]
    if w["kind"] == "Deployment":
        assert name.startswith("coordinator")
        assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"] == {"type": "Recreate"}
        assert serve_config(main["args"]).event_transport == "http"
        return
    assert name == "replicas"
    env = {e["name"]: e for e in main["env"]}
    config = serve_config([env_expand(a, {"POD_NAME": "blendmatch-replica-0"}) for a in main["args"]])
    assert config.event_transport == "kafka" and config.replica_id == "blendmatch-replica-0"
    assert "--replica-id=$(POD_NAME)" in main["args"]
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    headless = services[w["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert "clusterIP" not in services["blendmatch"]["spec"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] < w["spec"]["replicas"]


def test_servicemonitor_scrapes_metrics_of_a_service_that_exists(overlay, routes):
    _name, docs = overlay
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm) == {"apiVersion", "kind", "metadata", "spec"} and set(sm["spec"]) == {"selector", "endpoints"}
    want = sm["spec"]["selector"]["matchLabels"]
    (service,) = [d for d in docs if d["kind"] == "Service" and want.items() <= d["metadata"]["labels"].items()]
    ports = {p["name"] for p in service["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "tlsConfig"}
        assert ep["port"] in ports and ep["path"] == "/metrics" and ep["path"] in routes
        if "tlsConfig" in ep:
            assert ep["scheme"] == "https" and set(ep["tlsConfig"]) <= {"serverName", "ca", "insecureSkipVerify"}


def test_dashboard_configmap_is_the_dashboard(overlay):
    _name, docs = overlay
    source = (DEPLOY / "grafana" / "blendmatch.json").read_text()
    assert (KUSTOMIZE / "base" / "blendmatch.json").read_text() == source, \
        "deploy/kubernetes/base/blendmatch.json is a copy: cp deploy/grafana/blendmatch.json deploy/kubernetes/base/"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "blendmatch-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["data"] == {"blendmatch.json": source}


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("access.toml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_access_files_load(path):
    AccessPolicy.from_file(str(path))


# ------------------------------------------------------------------ container recipe
def _dockerfile(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip() if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_the_install_script_as_a_user_with_probes_and_entry_point(path, routes):
    steps = _dockerfile(path)
    froms = [v for k, v in steps if k == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build") and froms[1] == froms[0][:-len(" AS build")]
    runs = " ".join(v for k, v in steps if k == "RUN")
    assert "sh deploy/container/install.sh" in runs
    cache = re.search(r"BLENDMATCH_CACHE_DIR=(\S+)", runs).group(1)
    assert f"BLENDMATCH_CACHE_DIR={cache}" in " ".join(v for k, v in steps if k == "ENV")
    assert re.search(rf"--chown=\S+ {re.escape(cache)} {re.escape(cache)}$", " ".join(
        v for k, v in steps if k == "COPY" and cache in v)), "the runtime user owns the JIT cache (numba writes there)"
    (user,) = [v for k, v in steps if k == "USER"]
    assert user == "${UID}:${UID}" and re.search(r"ARG UID=([1-9]\d{3,})", path.read_text())
    assert [v for k, v in steps if k == "EXPOSE"] == ["9300"]
    (health,) = [v for k, v in steps if k == "HEALTHCHECK"]
    assert "BLENDMATCH_HEALTHCHECK_URL" in health
    url = re.search(r"BLENDMATCH_HEALTHCHECK_URL=(\S+)", " ".join(v for k, v in steps if k == "ENV")).group(1)
    assert url == "http://127.0.0.1:9300/healthz" and "/healthz" in routes
    (entry,) = [json.loads(v) for k, v in steps if k == "ENTRYPOINT"]
    (cmd,) = [json.loads(v) for k, v in steps if k == "CMD"]
    assert entry == ["blendmatch", "serve"]
    assert serve_config(cmd).port == 9300
    extras = re.search(r"BLENDMATCH_EXTRAS=(\S+)", runs).group(1).split(",")
    assert {"kafka", "kv-events"} <= set(extras) and ("gpu-cuda12" in extras) == path.name.endswith(".gpu")


def _checkov() -> str:
    exe = os.environ.get("CHECKOV") or shutil.which("checkov")
    if not exe:
        pytest.skip("checkov is not installed (a separate venv: python -m venv /tmp/ck && /tmp/ck/bin/pip install "
                    "checkov, then CHECKOV=/tmp/ck/bin/checkov); its pins would clash with the test extra")
    return exe


def _checkov_run(exe: str, target: Path, framework: str) -> list[dict[str, Any]]:
    out = subprocess.run([exe, "-d", str(target), "--framework", framework, "--output", "json", "--skip-download"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert out.stdout.strip(), out.stderr[-2000:]
    reports = json.loads(out.stdout)
    return reports if isinstance(reports, list) else [reports]


def test_checkov_passes_on_the_assembled_manifests_and_the_dockerfiles(tmp_path):
    exe = _checkov()
    for name in OVERLAYS:
        (tmp_path / "k8s").mkdir(exist_ok=True)
        (tmp_path / "k8s" / f"{name}.yaml").write_text(yaml.safe_dump_all(assemble(KUSTOMIZE / "overlays" / name)))
    for target, framework in ((tmp_path / "k8s", "kubernetes"), (DEPLOY / "container", "dockerfile")):
        for report in _checkov_run(exe, target, framework):
            results = report["results"]
            assert report["summary"]["passed"] > 0 and report["summary"]["parsing_errors"] == 0
            failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
            assert failed == [], f"{framework}: checkov failed {failed}"
            for c in results.get("skipped_checks", []):  # each skip says why, inline
                assert len(c.get("check_result", {}).get("suppress_comment", "")) > 20, c["check_id"]


# ------------------------------------------------------------------ compose
def test_compose_file_parses_and_each_blendmatch_command_parses(routes):
    from blendmatch.bench.kafka_stream import build_parser as stream_parser

    compose_dir = DEPLOY / "compose"
    spec = yaml.safe_load((compose_dir / "compose.yaml").read_text())
    services = spec["services"]
    assert {"broker", "topics", "replica-1", "replica-2", "generator", "prometheus", "grafana"} <= set(services)
    replicas = sorted(n for n, s in services.items() if s.get("image", "").startswith("blendmatch") and "entrypoint" not in s)
    assert replicas == ["replica-1", "replica-2"]
    ids, subnet = set(), spec["networks"]["fleet"]["ipam"]["config"][0]["subnet"]
    for name in replicas:
        s = services[name]
        config = serve_config(s["command"])
        assert config.event_transport == "kafka" and config.kafka_bootstrap_servers == "broker:9092"
        ids.add(config.replica_id)
        mounts = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert (compose_dir / mounts[config.access_file]).is_file()
        assert os.path.dirname(config.checkpoint_path) in mounts
        assert subnet in (compose_dir / mounts[config.access_file]).read_text()
        assert (ROOT / s["build"]["dockerfile"]).is_file() and s["stop_grace_period"] == "40s"
    assert len(ids) == 2, "each replica has its own --replica-id"
    gen = services["generator"]
    assert gen["entrypoint"] == ["python", "-m", "blendmatch.bench.kafka_stream"]
    assert gen["build"] == services["replica-1"]["build"] and gen["image"] == services["replica-1"]["image"]
    args = stream_parser().parse_args(gen["command"])
    assert args.bootstrap == "broker:9092" and args.topic == "lmcache-cache-events"
    prom = yaml.safe_load((compose_dir / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics" in routes
    assert sorted(job["static_configs"][0]["targets"]) == [f"{n}:9300" for n in replicas]
    grafana = services["grafana"]["volumes"]
    for v in grafana:
        assert (compose_dir / v.split(":")[0]).exists()
    for f in (compose_dir / "grafana").rglob("*.yml"):
        assert yaml.safe_load(f.read_text())["apiVersion"] == 1


# ------------------------------------------------------------------ systemd
UNIT = DEPLOY / "systemd" / "blendmatch.service"


def test_systemd_unit_is_hardened_and_its_command_parses():
    unit = unit_file(UNIT.read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    svc: dict[str, list[str]] = {}
    for k, v in unit["Service"]:
        svc.setdefault(k, []).append(v)
    one = {k: v[-1] for k, v in svc.items()}
    assert one["DynamicUser"] == "yes" and one["ProtectSystem"] == "strict" and one["Restart"] == "on-failure"
    assert one["ProtectHome"] == "yes" and one["NoNewPrivileges"] == "yes" and one["CapabilityBoundingSet"] == ""
    assert "ReadWritePaths" not in one and "ReadWriteDirectories" not in one, "state and cache are the only writable paths"
    argv = exec_argv(one["ExecStart"])
    assert argv[0].endswith("/bin/blendmatch") and argv[1] == "serve"
    config = serve_config(argv[2:])
    assert os.path.dirname(config.checkpoint_path) == f"/var/lib/{one['StateDirectory']}"
    env = dict(e.split("=", 1) for e in svc["Environment"])
    assert env["BLENDMATCH_CACHE_DIR"] == f"/var/cache/{one['CacheDirectory']}"
    assert int(one["TimeoutStopSec"]) > config.graceful_timeout
    assert config.access_file.startswith(f"/etc/{one['ConfigurationDirectory']}/")


def test_systemd_analyze_verify():
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd); the parse check above ran")
    unit = UNIT.read_text()
    exe = exec_argv(unit_file(unit)["Service"][[k for k, _ in unit_file(unit)["Service"]].index("ExecStart")][1])[0]
    # verify checks that ExecStart's program exists: point it at this environment's
    here = Path(sys.executable).parent / "blendmatch"
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"blendmatch-verify-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        (tmp / "blendmatch.service").write_text(unit.replace(exe, str(here)))
        out = subprocess.run([tool, "verify", str(tmp / "blendmatch.service")], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    finally:
        shutil.rmtree(tmp)


# ------------------------------------------------------------------ the install script
@pytest.mark.slow
def test_install_script_installs_and_compiles_into_a_fresh_venv(tmp_path):
    env = {**os.environ, "BLENDMATCH_PREFIX": str(tmp_path / "venv"), "BLENDMATCH_CACHE_DIR": str(tmp_path / "cache"),
           "BLENDMATCH_SRC": str(ROOT), "PYTHON": sys.executable, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    out = subprocess.run(["sh", str(DEPLOY / "container" / "install.sh")], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "install.sh: done" in out.stdout
    assert list((tmp_path / "cache").rglob("*.nbi")), "warm-up left no compiled numba code in the cache"
    version = subprocess.run([str(tmp_path / "venv" / "bin" / "blendmatch"), "--version"], capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("blendmatch ")
