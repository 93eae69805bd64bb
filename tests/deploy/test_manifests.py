"""The deployment files against the code, without running them: the Kubernetes manifests
(deploy/kubernetes) pass the Kubernetes schemas (kubernetes-validate, strict, on the
oldest and newest versions it knows of that we support), and in them and in the compose
file (deploy/compose/compose.yaml) every ``reservoir`` command parses with its options as
click would, every RESERVOIR_* variable is a setting or an option's variable and its value
parses, every port is the one the command listens on, every probe path is a route of the
``reservoir serve`` app, and every broker URL names a user, password and vhost of
deploy/rabbitmq/definitions.json on the RabbitMQ service's port; both run two roster
keepers, each under a name of its own, as the keeper user, trusted by every receiver that
checks users, and probed on the status file it writes."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import click
import kubernetes_validate
import pytest
import yaml

from reservoir.brokers import BrokerUrl
from reservoir.cli import main
from reservoir.runtime.settings import Settings
from reservoir.service import create_app

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.yaml"
RABBITMQ = ROOT / "deploy" / "rabbitmq"
#: the oldest Kubernetes the manifests are written for, and the newest the validator has
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
#: what $(NODE_NAME) and the like stand for when a command is parsed
DOWNWARD_API_EXAMPLE = "worker-1.example"


# -- reading the files ----------------------------------------------------------------------


def kubernetes_documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    documents = []
    for name in kustomization["resources"]:
        documents += [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]
    return documents


def with_defaults(text: str) -> str:
    """compose's ``${VAR:-default}`` and ``${VAR-default}``, as with VAR unset."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", text)


def compose_file() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(with_defaults(COMPOSE_FILE.read_text()))
    return loaded


@dataclass(frozen=True)
class Container:
    """One container a deployment file runs, as the checks need it."""

    where: str
    image: str
    argv: list[str]
    env: dict[str, str | None]  # None: from a Secret or the downward API
    ports: dict[str, int]  # name (or the number itself, as text) -> container port
    probe_paths: list[tuple[int | str, str]]  # (port, path) of HTTP probes
    exec_probes: list[list[str]]
    annotations: dict[str, str]


def kubernetes_containers() -> Iterator[Container]:
    for document in kubernetes_documents():
        template = document.get("spec", {}).get("template")
        if template is None:
            continue
        annotations = template.get("metadata", {}).get("annotations", {})
        spec = template["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            probes = [container[k] for k in container if k.endswith("Probe")]
            env = {
                e["name"]: e.get("value") if "valueFrom" not in e else None
                for e in container.get("env", [])
            }
            ports = {
                p.get("name", str(p["containerPort"])): p["containerPort"]
                for p in container.get("ports", [])
            }
            yield Container(
                where=f"{document['kind']}/{document['metadata']['name']}/{container['name']}",
                image=container["image"],
                argv=[*container.get("command", []), *container.get("args", [])],
                env=env,
                ports=ports,
                probe_paths=[
                    (p["httpGet"]["port"], p["httpGet"]["path"]) for p in probes if "httpGet" in p
                ],
                exec_probes=[p["exec"]["command"] for p in probes if "exec" in p],
                annotations=annotations,
            )


def compose_containers() -> Iterator[Container]:
    for name, service in compose_file()["services"].items():
        ports = {}
        for published in service.get("ports", []):
            container_port = str(published).rpartition(":")[2]
            ports[container_port] = int(container_port)
        test = service.get("healthcheck", {}).get("test", [])
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)(/[^'\"]*)", " ".join(test))
        yield Container(
            where=f"compose/{name}",
            image=service["image"],
            argv=list(service.get("command", [])),
            env=dict(service.get("environment", {})),
            ports=ports,
            probe_paths=[(int(port), path) for port, path in urls],
            exec_probes=[test[1:]] if test[:1] == ["CMD"] else [],
            annotations={},
        )


def reservoir_containers() -> list[Container]:
    every = [*kubernetes_containers(), *compose_containers()]
    return [c for c in every if c.argv[:1] == ["reservoir"]]


def resolved(argv: list[str]) -> list[str]:
    """``argv`` with Kubernetes' $(VAR) references filled in."""
    return [re.sub(r"\$\((\w+)\)", DOWNWARD_API_EXAMPLE, arg) for arg in argv]


def command_of(container: Container) -> tuple[click.Command, click.Context]:
    """The click command a container runs, parsed with its options (as click would at
    start: an unknown option or a bad value fails here)."""
    assert isinstance(main, click.Group)
    name, *args = resolved(container.argv)[1:]
    command = main.get_command(click.Context(main), name)
    assert command is not None, f"{container.where}: reservoir has no command {name!r}"
    # the container's own environment, as click reads it at start (a value from a Secret
    # stands in as a placeholder: it is there at run time)
    environment = {k: "from-a-secret" if v is None else v for k, v in container.env.items()}
    try:
        with mock.patch.dict(os.environ, environment):
            context = command.make_context(f"reservoir {name}", args)
    except click.ClickException as error:
        pytest.fail(
            f"{container.where}: reservoir {name} {' '.join(args)}: {error.format_message()}"
        )
    return command, context


def routes() -> set[str]:
    # from its OpenAPI document: FastAPI lists an included router as one entry of .routes
    return set(create_app("memory://").openapi()["paths"])


def definitions() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((RABBITMQ / "definitions.json").read_text())
    return loaded


def password_matches(password: str, hashed: str) -> bool:
    """rabbit_password_hashing_sha256: base64(salt + sha256(salt + password))."""
    raw = base64.b64decode(hashed)
    salt, digest = raw[:4], raw[4:]
    return hashlib.sha256(salt + password.encode()).digest() == digest


# -- Kubernetes schemas ------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_kubernetes_manifest_passes_the_kubernetes_schemas(version: str) -> None:
    documents = kubernetes_documents()
    kinds = {d["kind"] for d in documents}
    assert {"DaemonSet", "Deployment", "StatefulSet", "Service", "Secret"} <= kinds
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


def test_the_validator_refuses_a_misspelt_probe_and_a_port_that_is_not_a_number() -> None:
    (deployment,) = [
        d
        for d in kubernetes_documents()
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "reservoir-api"
    ]
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[-1], strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_the_rabbitmq_config_map_holds_deploy_rabbitmq_files_unchanged() -> None:
    (config,) = [d for d in kubernetes_documents() if d["kind"] == "ConfigMap"]
    assert config["data"]["20-reservoir.conf"] == (RABBITMQ / "rabbitmq.conf").read_text()
    assert json.loads(config["data"]["reservoir-definitions.json"]) == definitions()


def test_every_service_reaches_a_workload_through_a_port_it_has() -> None:
    documents = kubernetes_documents()
    workloads = [d for d in documents if "template" in d.get("spec", {})]
    for service in (d for d in documents if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        (workload,) = [
            w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        ports = {
            p.get("name"): p["containerPort"]
            for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports or target in ports.values(), (service["metadata"], target)


# -- commands, options, variables, ports and paths -----------------------------------------------


def test_the_deployment_files_run_the_node_agents_and_the_api() -> None:
    ran = [(c.where.split("/")[0], c.argv[1]) for c in reservoir_containers()]
    assert ran.count(("compose", "node")) == 3
    assert ran.count(("compose", "serve")) == 2
    assert ("DaemonSet", "node") in ran
    assert ("Deployment", "serve") in ran


def test_the_api_runs_as_two_replicas_alike_in_compose_and_on_kubernetes() -> None:
    """The service is stateless (GET and DELETE ask the nodes): both deployments run two
    replicas of it, each the same command with the same settings."""
    (api,) = [
        d
        for d in kubernetes_documents()
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "reservoir-api"
    ]
    assert api["spec"]["replicas"] >= 2
    (service,) = [
        d
        for d in kubernetes_documents()
        if d["kind"] == "Service" and d["metadata"]["name"] == "reservoir-api"
    ]
    # any replica may answer any request: no session affinity
    assert service["spec"].get("sessionAffinity", "None") == "None"
    composed = [c for c in compose_containers() if c.argv[:2] == ["reservoir", "serve"]]
    assert [c.where for c in composed] == ["compose/api", "compose/api-2"]
    first, second = composed
    assert (first.argv, first.env, first.probe_paths) == (
        second.argv,
        second.env,
        second.probe_paths,
    )
    # each on a loopback port of its own
    published = [compose_file()["services"][c.where.split("/")[1]]["ports"] for c in composed]
    assert len({str(p) for ports in published for p in ports}) == 2


@pytest.mark.parametrize("container", reservoir_containers(), ids=lambda c: c.where)
def test_every_reservoir_command_and_option_exists_and_parses(container: Container) -> None:
    command_of(container)


@pytest.mark.parametrize("container", reservoir_containers(), ids=lambda c: c.where)
def test_every_variable_is_a_setting_or_an_option_of_the_command_and_parses(
    container: Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    command, _ = command_of(container)
    settings = {f"RESERVOIR_{name.upper()}" for name in Settings.model_fields}
    options = {p.envvar for p in command.params if isinstance(p.envvar, str)}
    for name, value in container.env.items():
        if not name.startswith("RESERVOIR_"):
            # anything else is only there to be named in the command (the downward API)
            assert f"$({name})" in container.argv, f"{container.where}: {name} is used nowhere"
            continue
        assert name in settings | options, f"{container.where}: reservoir reads no {name}"
        if value is not None and name in settings:
            monkeypatch.setenv(name, value)
    Settings()  # every value given parses as its setting


@pytest.mark.parametrize("container", reservoir_containers(), ids=lambda c: c.where)
def test_every_port_is_the_one_the_command_listens_on(container: Container) -> None:
    _, context = command_of(container)
    listening = {
        "serve": [context.params.get("port")],
        "node": [context.params.get("metrics_port")],
        "keeper": [],
    }[context.info_name.split()[-1]]  # type: ignore[union-attr]
    listening = [p for p in listening if p is not None]
    assert sorted(container.ports.values()) == sorted(listening), container.where
    if container.where.startswith("compose/") or not listening:
        return
    scraped = container.annotations
    assert scraped.get("prometheus.io/scrape") == "true", container.where
    assert int(scraped["prometheus.io/port"]) in listening
    assert scraped["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("container", reservoir_containers(), ids=lambda c: c.where)
def test_every_probe_asks_a_route_of_the_service_on_its_port(container: Container) -> None:
    _, context = command_of(container)
    for port, path in container.probe_paths:
        assert context.info_name == "reservoir serve", f"{container.where} has no HTTP server"
        assert path in routes(), f"{container.where}: the app has no route {path}"
        assert container.ports.get(str(port), port) == context.params["port"], container.where
    if context.info_name == "reservoir serve":
        assert {p for _, p in container.probe_paths} >= {"/readyz"}, container.where
        if container.where.startswith("Deployment"):
            assert {p for _, p in container.probe_paths} == {"/healthz", "/readyz"}


def test_the_node_agents_health_check_is_the_same_on_kubernetes_as_in_compose() -> None:
    # the compose test runs it for real (the deployment must become healthy)
    (daemon_set,) = [c for c in reservoir_containers() if c.where.startswith("DaemonSet/")]
    compose_nodes = [c for c in reservoir_containers() if c.where.startswith("compose/")]
    compose_nodes = [c for c in compose_nodes if c.argv[1] == "node"]
    assert daemon_set.exec_probes
    for probe in daemon_set.exec_probes:
        for node in compose_nodes:
            assert node.exec_probes == [probe]
    # and the probe reads the directory the agent writes its status file in
    (state_dir,) = re.findall(r"'(/[^*']+)/\*", probe[-1])
    for node in [daemon_set, *compose_nodes]:
        assert node.argv[node.argv.index("--state-dir") + 1] == state_dir


def broker_urls() -> Iterator[tuple[str, str]]:
    for container in reservoir_containers():
        url = container.env.get("RESERVOIR_BROKER_URL")
        if url is not None:
            yield container.where, url
    for document in kubernetes_documents():
        if document["kind"] == "Secret":
            for key, url in document["stringData"].items():
                yield f"Secret/{document['metadata']['name']}/{key}", url


def test_every_broker_url_logs_in_as_a_user_of_the_definitions_on_the_service_port() -> None:
    users = {u["name"]: u["password_hash"] for u in definitions()["users"]}
    vhosts = {v["name"] for v in definitions()["vhosts"]}
    compose_rabbitmq = compose_file()["services"]["rabbitmq"]
    (service,) = [
        d
        for d in kubernetes_documents()
        if d["kind"] == "Service" and d["metadata"]["name"] == "rabbitmq"
    ]
    seen = 0
    for where, url in broker_urls():
        parsed = BrokerUrl.parse(url)
        assert parsed.username in users, where
        assert parsed.password is not None and password_matches(
            parsed.password, users[parsed.username]
        )
        assert parsed.vhost in vhosts, where
        if where.startswith("compose/"):
            assert parsed.host == "rabbitmq"
            assert any(str(p).endswith(f":{parsed.port}") for p in compose_rabbitmq["ports"])
        else:
            namespace = service["metadata"]["namespace"]
            assert parsed.host in ("rabbitmq", f"rabbitmq.{namespace}.svc"), where
            assert parsed.port in [p["port"] for p in service["spec"]["ports"]], where
        seen += 1
    assert seen >= 10  # seven compose services, the Secret's three URLs


def test_compose_publishes_ports_on_loopback_only() -> None:
    published = [p for s in compose_file()["services"].values() for p in s.get("ports", [])]
    assert len(published) == 3  # AMQP and the API's two replicas
    for port in published:
        host = str(port).partition(":")[0]
        assert host == "127.0.0.1", f"{port} is published beyond loopback"


# -- the roster keepers ---------------------------------------------------------------------


def keepers() -> list[Container]:
    return [c for c in reservoir_containers() if c.argv[1] == "keeper"]


def test_compose_and_kubernetes_run_two_roster_keepers_each_under_a_name_of_its_own() -> None:
    composed = [c for c in keepers() if c.where.startswith("compose/")]
    assert [c.where for c in composed] == ["compose/keeper-1", "compose/keeper-2"]
    names = [command_of(c)[1].params["name"] for c in composed]
    assert len(set(names)) == 2  # a keeper's inbox is an exclusive queue named after it
    (deployment,) = [
        d
        for d in kubernetes_documents()
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "reservoir-keeper"
    ]
    assert deployment["spec"]["replicas"] == 2
    (kubernetes,) = [c for c in keepers() if c.where.startswith("Deployment/")]
    # every replica gets its pod's name, unique in the namespace
    assert kubernetes.argv[kubernetes.argv.index("--name") + 1] == "$(POD_NAME)"
    (pod_name,) = [
        e
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"] == "POD_NAME"
    ]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def keeper_user() -> str:
    (user,) = [u["name"] for u in definitions()["users"] if "keeper" in u["name"]]
    return user


def test_the_keepers_log_in_as_the_keeper_user_and_every_receiver_that_checks_trusts_it() -> None:
    urls = dict(broker_urls())
    for container in keepers():
        url = urls.get(container.where)
        if url is None:  # from the Secret
            (secret,) = [d for d in kubernetes_documents() if d["kind"] == "Secret"]
            url = secret["stringData"]["keeper-url"]
        assert BrokerUrl.parse(url).username == keeper_user(), container.where
    # the keepers' roll calls (to nodes), samples and news (to requestors) are requestor
    # kinds: a receiver that lists the requestors' users must list the keeper's too
    for container in reservoir_containers():
        listed = container.env.get("RESERVOIR_REQUESTOR_USERS")
        if listed is not None:
            assert keeper_user() in json.loads(listed), container.where


def test_the_keeper_user_may_publish_what_a_keeper_publishes() -> None:
    """Its roll call on a tier topic, its news that it is up on ``roster``, queries'
    answers to requestors' inboxes; and bind what it hears."""
    permissions = {
        p["exchange"]: p for p in definitions()["topic_permissions"] if p["user"] == keeper_user()
    }
    request_exchange = permissions["reservoir"]
    for topic in ("tier.100", "roster"):
        assert re.fullmatch(request_exchange["write"], topic), topic
    for topic in ("roster", "roster.room", "keeper"):
        assert re.fullmatch(request_exchange["read"], topic), topic
    assert re.fullmatch(permissions["reservoir.inbox"]["write"], "reservoir.requestor.r-1")


def test_every_keepers_health_check_reads_the_status_file_it_writes() -> None:
    assert len(keepers()) == 3  # compose's two, the Deployment's one container
    for container in keepers():
        _, context = command_of(container)
        status_file = str(context.params["status_file"])
        probes = container.exec_probes
        assert probes, f"{container.where} has no health check"
        for probe in probes:
            assert f"'{status_file}'" in probe[-1], container.where
