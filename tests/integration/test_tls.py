"""``amqps://`` against a RabbitMQ TLS listener the test configures with certificates it
generates: the broker's certificate and host name are checked against the test's CA, the
client presents a certificate of its own, and placement works over it on both adapters.
A client that trusts another CA, or names another host, is refused.

Needs the machine's ``rabbitmq-server`` and root (a RabbitMQ node of the test's own);
skipped without them, failed under ``CI``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from reservoir import NodeAgent, Requestor
from reservoir.broker import BrokerError
from reservoir.brokers import connect
from reservoir.runtime.auditor import audit_cluster
from reservoir.testing.rabbitmq_cluster import ClusterUnavailable, RabbitMqCluster
from reservoir.testing.tls import TlsFiles, make_tls_files

pytestmark = pytest.mark.rabbitmq


@pytest.fixture(scope="module")
def tls_broker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RabbitMqCluster, TlsFiles]]:
    base = Path(tmp_path_factory.mktemp("tls"))
    files = make_tls_files(base / "certs")
    try:
        broker = RabbitMqCluster(base / "rabbitmq", size=1, tls=files)
    except ClusterUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the TLS test: {error}")
        pytest.skip(str(error))
    with broker:
        yield broker, files


def tls_url(
    broker: RabbitMqCluster,
    files: TlsFiles,
    *,
    scheme: str = "amqps",
    ca: Path | None = None,
    host: str = "localhost",
) -> str:
    base = broker.tls_url(0, scheme=scheme).replace("@localhost:", f"@{host}:")
    query = "&".join(
        f"{key}={quote(str(path), safe='')}"
        for key, path in (
            ("tls_ca", ca or files.ca_cert),
            ("tls_cert", files.client_cert),
            ("tls_key", files.client_key),
        )
    )
    return f"{base}?{query}"


@pytest.mark.parametrize("scheme", ["amqps", "kombu+amqps"])
def test_placement_over_tls_with_a_client_certificate(
    tls_broker: tuple[RabbitMqCluster, TlsFiles], scheme: str
) -> None:
    cluster, files = tls_broker
    url = tls_url(cluster, files, scheme=scheme)
    with connect(url) as broker:
        node = NodeAgent(broker, name=f"tls-{scheme}", vcpus=4, memory_mb=4096)
        try:
            with Requestor(broker) as requestor:
                placement = requestor.reserve(vcpus=1, memory_mb=256, timeout_s=20)
            found = audit_cluster(broker, placements=[placement], expect_nodes=1, wait_s=10)
            assert found.ok and found.orphans == (), found.as_json()
        finally:
            node.close()


def test_a_broker_certificate_from_another_ca_is_refused(
    tls_broker: tuple[RabbitMqCluster, TlsFiles],
) -> None:
    cluster, files = tls_broker
    with pytest.raises(BrokerError, match=r"(?i)certificate"):
        connect(tls_url(cluster, files, ca=files.other_ca_cert)).close()


def test_a_host_name_the_certificate_does_not_name_is_refused(
    tls_broker: tuple[RabbitMqCluster, TlsFiles],
) -> None:
    cluster, files = tls_broker
    # 127.0.0.1 is the very listener, but the certificate names localhost only
    with pytest.raises(BrokerError, match=r"(?i)certificate|hostname|match"):
        connect(tls_url(cluster, files, host="127.0.0.1")).close()
