"""Offline checks of deploy/k8s: Kubernetes' schemas, the custom resources, the image contract.

Renders the base and every overlay (`kubectl kustomize`), validates built-in kinds strictly against
Kubernetes' JSON schemas (`kubernetes-validate` >= 1.37, offline), checks ScaledObject/ServiceMonitor
by hand and the pod against the image (deploy/Dockerfile) and its rivulet.toml; exits non-zero naming
each target's first failed check. Usage: python tests/python/check_manifests.py [--dockerfile FILE]
"""

import argparse
import ipaddress
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path, PurePosixPath

import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, VersionNotSupportedError

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests claim (unhealthyPodEvictionPolicy is GA from 1.31) and the
# newest that kubernetes-validate 1.37.0 bundles; named, so a package upgrade changes nothing.
K8S_VERSIONS = ("1.31.0", "1.37.0")
# The image contract while deploy/Dockerfile does not exist yet.
CUTOFF_SECS = 5  # server.rs: open connections are cut shutdown_timeout_secs + 5 s after SIGTERM
METRIC = "rivulet:num_requests_waiting"


class Failed(Exception):
    """A check that did not hold; the message says what and where."""


class Report:
    """Counts the checks that held, so the summary shows how much each target was tested."""
    passed = 0

    def check(self, condition, message):
        if not condition:
            raise Failed(message)
        self.passed += 1


def program(command):
    """The program a command line runs, looking past wrappers (`tini -- rivulet-worker`)."""
    names = [PurePosixPath(word).name for word in command]
    return next((n for n in names if n.startswith("rivulet-")), names[0] if names else None)


def stage_lines(lines, stage):
    """The instructions that make up `stage` (default: the last one): its own, after those of the
    stage it is built FROM when that is a stage of the same file (e.g. `FROM runtime AS with-model`)."""
    stages, current = {}, None
    for line in lines:
        if line.upper().startswith("FROM "):
            words = line.split()
            name = words[3] if len(words) > 3 and words[2].upper() == "AS" else f"#{len(stages)}"
            current = stages[name] = {"base": words[1], "lines": []}
        elif current is not None:
            current["lines"].append(line)
    name = stage if stage in stages else list(stages)[-1]
    chain = []
    while name in stages:
        chain = stages[name]["lines"] + chain
        name = stages[name]["base"]
    return chain


def image_facts(dockerfile, stage="runtime"):
    """The image contract from the Dockerfile's `runtime` stage (the `rivulet:cpu` image; the
    with-model stage builds on it), so that a port or uid changed there fails here rather than in
    the pods."""
    if not dockerfile.exists():
        raise Failed(f"{dockerfile} does not exist: the pods cannot be checked against the image")
    lines = [l.strip() for l in re.sub(r"\\\n", " ", dockerfile.read_text()).splitlines()]
    lines = [l for l in lines if l and not l.startswith("#")]
    facts = {"ports": set()}
    for line in stage_lines(lines, stage):
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "EXPOSE":
            facts["ports"] |= {int(p.split("/")[0]) for p in rest.split()}
        elif instruction == "USER":
            user, _, group = rest.partition(":")
            if not user.isdigit() or not (group or user).isdigit():
                raise Failed(f"{dockerfile}: USER {rest} must be numeric, or runAsNonRoot cannot verify it")
            facts["uid"], facts["gid"] = int(user), int(group or user)
        elif instruction == "ENV":
            words = shlex.split(rest)
            pairs = [w.partition("=") for w in words] if "=" in words[0] else [(words[0], "", " ".join(words[1:]))]
            facts.update({"config": value for key, _, value in pairs if key == "RIVULET_CONFIG"})
        elif instruction == "ENTRYPOINT":
            facts["entrypoint"] = program(json.loads(rest) if rest.startswith("[") else shlex.split(rest))
    wanted = {"uid": "USER", "config": "ENV RIVULET_CONFIG", "entrypoint": "ENTRYPOINT"}
    missing = [v for k, v in wanted.items() if k not in facts] + ([] if facts["ports"] else ["EXPOSE"])
    if missing:
        raise Failed(f"{dockerfile}: no {', '.join(missing)} in the {stage} stage")
    return facts


def known_config_keys():
    """Every (section, key) rivulet.example.toml documents, commented-out ones included: the
    scheduler rejects unknown keys (deny_unknown_fields), so a typo would stop every pod."""
    keys, section = set(), None
    for line in (ROOT / "rivulet.example.toml").read_text().splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            section = m.group(1)
        elif section and (m := re.match(r"^#?\s*(\w+)\s*=", line)):
            keys.add((section, m.group(1)))
    return keys


def render(target):
    """`kubectl kustomize` of one directory: exactly what `kubectl apply -k` would send."""
    try:
        result = subprocess.run(["kubectl", "kustomize", str(target)], capture_output=True, text=True)
    except FileNotFoundError:
        raise Failed("kubectl is not installed: it renders the overlays (`kubectl kustomize`)") from None
    if result.returncode != 0:
        raise Failed(f"kubectl kustomize {target.relative_to(ROOT)}:\n{result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def is_custom(doc):
    """Custom resources have a dotted API group outside *.k8s.io (keda.sh, monitoring.coreos.com)."""
    group = doc["apiVersion"].rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def validate_schemas(docs, report):
    """Strict schema validation of the built-in kinds: a misspelt or misplaced field fails here
    instead of being refused (or silently dropped) by the API server."""
    for doc in (d for d in docs if not is_custom(d)):
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise Failed(f"{name}, Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")
            except SchemaNotFoundError as e:
                raise Failed(f"{e.message}: no schema, and no hand check here either")
            except VersionNotSupportedError:
                raise Failed(f"this kubernetes-validate lacks Kubernetes {version}: pip install -U kubernetes-validate")
            report.passed += 1


def quantity(value):
    """A Kubernetes quantity ("2", "500m", "3Gi") as a number."""
    number, suffix = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value)).groups()
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(number) * scale[suffix]


def parse_listen(address):
    """A listen address ("0.0.0.0:8000", "[::]:8000") as its port and whether it is loopback,
    i.e. reachable only from inside the pod."""
    host, _, port = address.rpartition(":")
    return int(port), ipaddress.ip_address(host.strip("[]")).is_loopback


def env_of(container):
    """A container's literal env vars (valueFrom ones read as None)."""
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def prestop_pause(container):
    """Seconds a preStop hook holds SIGTERM back (`sleep` by exec or the native sleep action)."""
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    command = pre.get("exec", {}).get("command", [])
    return int(command[1]) if command and PurePosixPath(command[0]).name == "sleep" else 0


def mount_volume(container, path, volumes):
    """The volume a container sees at `path` (the deepest mount containing it), or None."""
    mounts = [m for m in container.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    return volumes[max(mounts, key=lambda m: len(m["mountPath"]))["name"]] if mounts else None


def resolve_port(container, port):
    """A probe's or Service's target port, by name or number, as a declared container port."""
    return next((p["containerPort"] for p in container.get("ports", []) if port in (p.get("name"), p["containerPort"])),
                None)


def selects(selector, labels):
    """Whether a (non-empty) matchLabels selector selects objects with these labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def effective_config(scheduler, volumes, configmaps, facts, report):
    """The scheduler's configuration as the pod gives it: the ConfigMap file at RIVULET_CONFIG,
    then RIVULET_<SECTION>__<KEY> env overrides; every key must be one the scheduler knows."""
    path = env_of(scheduler).get("RIVULET_CONFIG") or facts["config"]
    volume = mount_volume(scheduler, path, volumes)
    report.check(volume and "configMap" in volume, f"RIVULET_CONFIG {path} is not on a ConfigMap volume")
    data, key = configmaps.get(volume["configMap"]["name"], {}).get("data", {}), PurePosixPath(path).name
    report.check(key in data, f"ConfigMap {volume['configMap']['name']} has no {key} (RIVULET_CONFIG {path})")
    config = tomllib.loads(data[key])
    for name, value in env_of(scheduler).items():
        if m := re.fullmatch(r"RIVULET_([A-Z]+)__([A-Z_]+)", name):
            config.setdefault(m.group(1).lower(), {})[m.group(2).lower()] = value
    unknown = {(s, k) for s, table in config.items() for k in table} - known_config_keys()
    report.check(not unknown, f"keys the scheduler would reject at start: {sorted(unknown)}")
    return config


def check_pod(pod, configmaps, facts, report):
    """The pod against the image and against its own configuration; returns the scheduler container."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    runs = lambda c: program(c.get("command") or [facts["entrypoint"]])
    schedulers = [c for c in pod["containers"] if runs(c) == "rivulet-scheduler"]
    workers = [c for c in pod["containers"] if runs(c) == "rivulet-worker"]
    report.check(len(schedulers) == 1, f"{len(schedulers)} scheduler containers (want 1)")
    scheduler = schedulers[0]
    config = effective_config(scheduler, volumes, configmaps, facts, report)
    server, worker_config = config.get("server", {}), config.get("worker", {})
    listens = server.get("listen", "127.0.0.1:50051"), server.get("http_listen", "127.0.0.1:8000")  # the defaults
    (grpc_port, grpc_local), (http_port, http_local) = map(parse_listen, listens)
    report.check(not grpc_local and not http_local, "server.listen and http_listen must not be loopback: unreachable")
    admin_port, admin_local = parse_listen(server.get("admin_listen", "127.0.0.1:50052"))
    report.check(admin_local, "server.admin_listen must stay on loopback (or needs server.api_key)")
    ports = {p.get("name"): p["containerPort"] for p in scheduler.get("ports", [])}
    for name, port in (("grpc", grpc_port), ("http", http_port)):
        report.check(ports.get(name) == port, f"container port {name} {ports.get(name)} != the TOML's {port}")
    report.check(set(ports.values()) <= facts["ports"],
                 f"container ports {sorted(ports.values())} are not all EXPOSEd {sorted(facts['ports'])}")
    report.check(admin_port not in ports.values(), "the loopback admin port is declared on the container")
    for kind in ("startupProbe", "readinessProbe"):
        probe = scheduler.get(kind, {}).get("httpGet", {})
        report.check(probe.get("path") == "/health" and resolve_port(scheduler, probe.get("port")) == http_port,
                     f"{kind} must be GET /health on the http port {http_port}, is {probe}")
    startup = scheduler["startupProbe"]
    budget = startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10)
    report.check(budget >= int(worker_config.get("startup_timeout_secs", 300)),
                 f"the startupProbe allows {budget} s, less than worker.startup_timeout_secs")
    live = scheduler.get("livenessProbe", {})
    live_port = resolve_port(scheduler, (live.get("httpGet") or live.get("tcpSocket") or {}).get("port"))
    report.check(live_port in (http_port, grpc_port) and live.get("httpGet", {}).get("path") != "/health",
                 f"the livenessProbe must reach the server but not /health (503 while a worker restarts): {live}")
    for c in pod["containers"]:
        sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        user = (sc.get("runAsUser"), sc.get("runAsGroup"), sc.get("runAsNonRoot"))
        report.check(user == (facts["uid"], facts["gid"], True),
                     f"{c['name']}: runAsUser, runAsGroup, runAsNonRoot {user}; the image's user is {facts['uid']}")
        shm = (mount_volume(c, "/dev/shm", volumes) or {}).get("emptyDir", {})
        report.check(shm.get("medium") == "Memory" and shm.get("sizeLimit"),
                     f"{c['name']}: /dev/shm must be an emptyDir with medium Memory and a sizeLimit")
        model = config["model"]["path"]
        report.check(mount_volume(c, model, volumes) or "with-model" in c["image"],
                     f"{c['name']}: nothing mounted at model.path {model}, and {c['image']} holds no model")
    drain = prestop_pause(scheduler) + int(server.get("shutdown_timeout_secs", 30)) + CUTOFF_SECS
    grace = pod.get("terminationGracePeriodSeconds", 30)
    report.check(grace > drain, f"terminationGracePeriodSeconds {grace} <= preStop + drain + cut-off = {drain}")
    if not workers:  # the CPU shape: workers are the scheduler's children, in its container
        replicas, threads = int(worker_config.get("replicas", 1)), int(worker_config.get("threads", 0))
        limits = scheduler.get("resources", {}).get("limits", {})
        report.check(replicas >= 1, "worker.replicas = 0 and no worker container: nothing could serve")
        report.check(threads * replicas <= quantity(limits.get("cpu", 0)),
                     f"{replicas} worker(s) x {threads} threads exceed the CPU limit")
        report.check("kv_cache_memory_fraction" in worker_config
                     or quantity(limits.get("memory", 0)) > int(worker_config.get("kv_cache_memory", 2**30)),
                     "the memory limit does not even hold worker.kv_cache_memory")
        return scheduler
    # The GPU shape: worker containers attach through a volume they share with the scheduler.
    socket = worker_config.get("attach_socket")
    report.check(int(worker_config.get("replicas", 1)) == 0,
                 "worker containers and spawned workers: set worker.replicas = 0 (spawned ones would share a GPU)")
    report.check(socket, "worker containers, but no worker.attach_socket")
    sockets, tmpdir = mount_volume(scheduler, socket, volumes), env_of(scheduler).get("TMPDIR", "/tmp")
    report.check(sockets and sockets is mount_volume(scheduler, tmpdir, volumes),
                 f"the scheduler's TMPDIR {tmpdir} must be on the volume of {socket} (the handshake sockets)")
    for w in workers:
        args = w.get("command", [])[1:] + w.get("args", [])
        attach = args[args.index("--attach") + 1] if "--attach" in args else None
        report.check(attach == socket, f"{w['name']}: --attach {attach} != worker.attach_socket {socket}")
        report.check(mount_volume(w, socket, volumes) is sockets, f"{w['name']}: does not mount {socket}'s volume")
        report.check(mount_volume(w, "/dev/shm", volumes) is mount_volume(scheduler, "/dev/shm", volumes),
                     f"{w['name']}: /dev/shm is not the scheduler's volume")
        gpus = quantity(w.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        report.check(gpus >= 1, f"{w['name']}: no nvidia.com/gpu limit")
        report.check(drain <= prestop_pause(w) < grace,
                     f"{w['name']}: its preStop must outlast the drain ({drain} s) and end within the grace period")
    return scheduler


def check_services(docs, pod_labels, scheduler, report):
    """The Services and the PDB select the pods, target declared ports, and gRPC goes headless."""
    services = [d for d in docs if d["kind"] == "Service"]
    for svc in services:
        name, spec = svc["metadata"]["name"], svc["spec"]
        report.check(selects(spec.get("selector"), pod_labels), f"Service {name} selects no rivulet pod")
        for p in spec["ports"]:
            target = resolve_port(scheduler, p.get("targetPort", p["port"]))
            report.check(target is not None, f"Service {name} port {p.get('name')} targets no container port")
            report.check(spec.get("clusterIP") != "None" or target == p["port"],
                         f"headless Service {name}: port {p['port']} != container port {target} (clients dial pods)")
    grpc = [s for s in services if any(p.get("name") == "grpc" for p in s["spec"]["ports"])]
    report.check(grpc and all(s["spec"].get("clusterIP") == "None" for s in grpc), "the gRPC Service must be headless")
    report.check(all(p.get("appProtocol") == "grpc" for s in grpc for p in s["spec"]["ports"]), "appProtocol grpc")
    report.check(any(p.get("name") == "http" for s in services for p in s["spec"]["ports"]), "no Service port http")
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    report.check(pdbs and all(selects(p["spec"]["selector"].get("matchLabels"), pod_labels) for p in pdbs),
                 "no PodDisruptionBudget selecting the pods")


def check_service_monitor(doc, docs, scheduler, report):
    """The ServiceMonitor (custom) scrapes /metrics through a Service port on the HTTP listener.
    Returns the scraped Service's name: Prometheus puts it in the `job` label the scalers query."""
    name = doc.get("metadata", {}).get("name")
    report.check(doc["apiVersion"] == "monitoring.coreos.com/v1" and name, "ServiceMonitor: apiVersion, metadata.name")
    selector = doc.get("spec", {}).get("selector", {}).get("matchLabels")
    matched = [s for s in docs if s["kind"] == "Service" and selects(selector, s["metadata"].get("labels", {}))]
    report.check(len(matched) == 1, f"ServiceMonitor {name} selects {len(matched)} Services (want 1)")
    service, ports = matched[0]["metadata"]["name"], {p.get("name"): p for p in matched[0]["spec"]["ports"]}
    report.check(doc["spec"].get("endpoints"), f"ServiceMonitor {name}: no endpoints")
    for e in doc["spec"]["endpoints"]:
        report.check(e.get("port") in ports, f"ServiceMonitor {name}: port {e.get('port')} is not on {service}")
        report.check(e.get("path") == "/metrics", f"ServiceMonitor {name}: path {e.get('path')} != /metrics")
        report.check(resolve_port(scheduler, ports[e["port"]].get("targetPort")) == resolve_port(scheduler, "http"),
                     f"ServiceMonitor {name}: port {e['port']} does not reach the http listener")
    return service


def check_scaled_object(doc, deployment, job, report):
    """The KEDA ScaledObject (custom): targets the Deployment, scales on queue depth from Prometheus."""
    spec, name = doc.get("spec", {}), doc.get("metadata", {}).get("name")
    report.check(doc["apiVersion"] == "keda.sh/v1alpha1" and name, "ScaledObject: apiVersion, metadata.name")
    target = spec.get("scaleTargetRef", {})
    report.check(target.get("kind", "Deployment") == "Deployment" and target.get("name") == deployment,
                 f"ScaledObject {name} targets {target}, not Deployment {deployment}")
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    report.check(1 <= low <= high, f"ScaledObject {name}: replicas {low}..{high} (at 0 no queue is left)")
    triggers = [t.get("metadata", {}) for t in spec.get("triggers", []) if t.get("type") == "prometheus"]
    report.check(triggers, f"ScaledObject {name}: no prometheus trigger")
    for t in triggers:
        report.check(t.get("serverAddress", "").startswith("http"), f"ScaledObject {name}: serverAddress {t}")
        report.check(METRIC in t.get("query", ""), f"ScaledObject {name}: the query does not read {METRIC}")
        jobs = re.findall(r'job="([^"]*)"', t["query"])
        report.check(all(j == job for j in jobs), f"ScaledObject {name}: query job {jobs} != scraped Service {job}")
        report.check(float(t.get("threshold", 0)) > 0, f"ScaledObject {name}: threshold {t.get('threshold')}")


def check_hpa(doc, deployment, job, report):
    """The HPA alternative: an External metric that prometheus-adapter's rules (kept in the hpa
    component) derive from the queue-depth series of the scraped Service's job."""
    spec, name = doc["spec"], doc["metadata"]["name"]
    target = spec["scaleTargetRef"]
    report.check(target["kind"] == "Deployment" and target["name"] == deployment, f"HPA {name} targets {target}")
    rules = yaml.safe_load((K8S / "components/hpa/prometheus-adapter-rules.yaml").read_text())["rules"]["external"]
    served = {re.sub(r["name"]["matches"], re.sub(r"\$\{?(\d)\}?", r"\\\1", r["name"]["as"]), METRIC)
              for r in rules if METRIC in r["seriesQuery"]}
    metrics = [m["external"] for m in spec.get("metrics", []) if m["type"] == "External"]
    report.check(metrics, f"HPA {name}: no External metric (scale on queue depth, not CPU)")
    for m in metrics:
        report.check(m["metric"]["name"] in served, f"HPA {name}: {m['metric']['name']} is not served ({served})")
        job_label = m["metric"].get("selector", {}).get("matchLabels", {}).get("job", job)
        report.check(job_label == job, f"HPA {name}: job {job_label} != scraped Service {job}")
        report.check(m["target"]["type"] == "AverageValue", f"HPA {name}: the target must be per pod (AverageValue)")


def check_target(directory, facts, report):
    """Everything about one overlay: schemas, the pod, Services, scraping, exactly one autoscaler.
    The base only has to apply on a bare cluster: valid built-in kinds, no custom resources."""
    docs = render(directory)
    validate_schemas(docs, report)
    if directory.name == "base":
        report.check(not any(is_custom(d) for d in docs), "the base holds custom resources")
        return docs
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    report.check(len(deployments) == 1, f"{len(deployments)} Deployments (want 1)")
    deployment, template = deployments[0]["metadata"]["name"], deployments[0]["spec"]["template"]
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    scheduler = check_pod(template["spec"], configmaps, facts, report)
    check_services(docs, template["metadata"]["labels"], scheduler, report)
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    report.check(len(monitors) == 1, f"{len(monitors)} ServiceMonitors (want 1: the autoscalers read its metric)")
    job = check_service_monitor(monitors[0], docs, scheduler, report)
    scalers = [d for d in docs if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    report.check(len(scalers) == 1, f"{len(scalers)} autoscalers on the Deployment: include keda or hpa, one")
    (check_scaled_object if scalers[0]["kind"] == "ScaledObject" else check_hpa)(scalers[0], deployment, job, report)
    unchecked = {d["kind"] for d in docs if is_custom(d)} - {"ScaledObject", "ServiceMonitor"}
    report.check(not unchecked, f"custom kinds without a hand check here: {sorted(unchecked)}")
    return docs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dockerfile", type=Path, default=ROOT / "deploy" / "Dockerfile")
    args = parser.parse_args()
    print(f"kubernetes-validate {kubernetes_validate.__version__}, strict, Kubernetes {', '.join(K8S_VERSIONS)}")
    try:
        facts = image_facts(args.dockerfile)
    except Failed as e:
        print(f"FAIL image: {e}")
        return 1
    overlays = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
    if not overlays:
        print("FAIL: no overlays under deploy/k8s/overlays")
    failures = int(not overlays)
    for directory in [K8S / "base"] + overlays:
        report = Report()
        try:
            docs = check_target(directory, facts, report)
            kinds = ", ".join(sorted({d["kind"] for d in docs}))
            print(f"ok   {directory.name}: {kinds}; {report.passed} checks passed")
        except (Failed, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            why = e if isinstance(e, Failed) else f"a missing or malformed field: {e!r}"
            print(f"FAIL {directory.name} (after {report.passed} checks passed): {why}")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
